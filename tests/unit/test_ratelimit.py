import pytest

from ckptdrain.daemon.ratelimit import ErrorAllowance, TokenBucket


def test_unlimited_never_waits() -> None:
    bucket = TokenBucket(0)
    assert bucket.reserve(10**12, now=0.0) == 0.0


def test_burst_then_paced_at_rate() -> None:
    bucket = TokenBucket(100.0, burst_bytes=100)
    assert bucket.reserve(100, now=0.0) == 0.0  # the burst
    assert bucket.reserve(50, now=0.0) == 0.5  # in debt: wait for 50 tokens at 100/s
    assert bucket.reserve(50, now=0.5) == 0.5  # the debt is paid, the new 50 wait again


def test_default_burst_is_a_tenth_of_a_second() -> None:
    bucket = TokenBucket(1000.0)
    assert bucket.reserve(100, now=0.0) == 0.0
    assert bucket.reserve(100, now=0.0) == 0.1


def test_large_reservation_is_paced_not_refused() -> None:
    bucket = TokenBucket(10.0, burst_bytes=10)
    assert bucket.reserve(1000, now=0.0) == 99.0


def test_sustained_rate_over_many_reservations() -> None:
    bucket = TokenBucket(1000.0, burst_bytes=1000)
    now = 0.0
    for _ in range(100):
        now += bucket.reserve(100, now)
    # 100 x 100 bytes at 1000 B/s with a 1000-byte burst: 9 s of waiting.
    assert abs(now - 9.0) < 1e-9


def test_idle_time_refills_only_up_to_burst() -> None:
    bucket = TokenBucket(10.0, burst_bytes=10)
    bucket.reserve(10, now=0.0)
    assert bucket.reserve(10, now=1000.0) == 0.0
    assert bucket.reserve(5, now=1000.0) == 0.5


def test_an_error_allowance_is_a_burst_then_a_rate() -> None:
    allowance = ErrorAllowance()
    for _ in range(3):  # the burst: 3 errors at 1 a second
        allowance.record(7, now=0.0, rate=1.0, burst=3)
    assert allowance.delay(7, now=0.0, rate=1.0, burst=3) == 0.0
    allowance.record(7, now=0.0, rate=1.0, burst=3)
    assert allowance.delay(7, now=0.0, rate=1.0, burst=3) == 1.0  # one over: a second's wait
    assert allowance.delay(7, now=0.5, rate=1.0, burst=3) == 0.5
    assert allowance.delay(8, now=0.0, rate=1.0, burst=3) == 0.0  # only the uid that erred
    assert allowance.delay(7, now=4.0, rate=1.0, burst=3) == 0.0  # paid: the uid leaves
    assert len(allowance) == 0


def test_an_error_allowance_of_rate_zero_holds_nothing_back() -> None:
    allowance = ErrorAllowance()
    for _ in range(1000):
        allowance.record(7, now=0.0, rate=0.0, burst=1)
    assert allowance.delay(7, now=0.0, rate=0.0, burst=1) == 0.0
    assert len(allowance) == 0
    for _ in range(10):
        allowance.record(7, now=0.0, rate=1.0, burst=3)
    # A reload that turns it off lets a uid in debt go at once.
    assert allowance.delay(7, now=0.0, rate=0.0, burst=1) == 0.0


def test_an_error_allowance_forgets_paid_uids_before_it_grows() -> None:
    allowance = ErrorAllowance()
    for uid in range(ErrorAllowance.PRUNE_AT):
        allowance.record(uid, now=0.0, rate=1.0, burst=1)
    allowance.record(10**6, now=5.0, rate=1.0, burst=1)  # all the others have paid by now
    assert len(allowance) == 1


def test_an_error_allowance_raised_by_a_reload_shortens_the_wait_at_once() -> None:
    # Found attacking: the debt was kept as a moment accrued at the old rate, so raising the
    # rate lengthened the wait (30 errors at 1 a second, burst 5: 25 s, and 29.99 s at 1000).
    allowance = ErrorAllowance()
    for _ in range(30):
        allowance.record(7, now=0.0, rate=1.0, burst=3)
    assert allowance.delay(7, now=0.0, rate=1.0, burst=5) == 25.0
    assert allowance.delay(7, now=0.0, rate=1000.0, burst=5) == pytest.approx(0.025)
    assert allowance.delay(7, now=0.0, rate=1.0, burst=1000) == 0.0


def test_an_error_allowance_lowered_by_a_reload_brings_back_no_paid_debt() -> None:
    # Found reviewing: the debt drained at the rate in force over the whole time since it was
    # counted, so a reload to a lower rate an hour later held a uid for 1400 s it had paid.
    allowance = ErrorAllowance()
    for _ in range(150):
        allowance.record(7, now=0.0, rate=20.0, burst=100)
    assert allowance.delay(7, now=2.5, rate=20.0, burst=100) == 0.0  # 100 owed: the burst
    assert allowance.delay(7, now=3600.0, rate=0.01, burst=100) == 0.0
    # Debt not yet paid at the reload drains at the new rate from then on.
    for _ in range(110):
        allowance.record(8, now=4000.0, rate=0.5, burst=100)
    assert allowance.delay(8, now=4000.0, rate=1.0, burst=100) == 10.0
    assert allowance.delay(8, now=4004.0, rate=1.0, burst=100) == 6.0


def test_an_error_allowance_turned_off_forgives_every_debt() -> None:
    allowance = ErrorAllowance()
    for _ in range(50):
        allowance.record(7, now=0.0, rate=1.0, burst=3)
    assert allowance.delay(7, now=0.0, rate=0.0, burst=3) == 0.0
    assert allowance.delay(7, now=0.0, rate=1.0, burst=3) == 0.0
    assert len(allowance) == 0


def test_an_error_allowance_caps_a_debt_at_a_minute_past_the_burst() -> None:
    # Found reviewing: uncapped, 10,000 errors in one moment (connects refused at the uid's
    # cap, half a second of looping) held that uid's every connection for 495 s.
    allowance = ErrorAllowance()
    for _ in range(10_000):
        allowance.record(7, now=0.0, rate=20.0, burst=100)
    assert allowance.delay(7, now=0.0, rate=20.0, burst=100) == ErrorAllowance.DEBT_MAX_S
    assert allowance.delay(7, now=ErrorAllowance.DEBT_MAX_S, rate=20.0, burst=100) == 0.0
