"""ckptdrain's benchmarks: ``python -m tests.bench`` (``make bench``), not part of ``make test``.

Each benchmark measures ckptdrain and a plain baseline side by side on the same data and disk
and reports ratios of medians (report.py), written to docs/benchmarks.md by a full run.

    suite.py        the registry and the per-benchmark context (directories, daemons, S3)
    processes.py    real daemons and baseline commands; CPU and RSS read from /proc
    workload.py     the shard bytes, and the plain operations both sides share
    handoff.py      hand-off stall, ack=local and ack=memory
    throughput.py   socket bytes into the daemon vs a bare pair (bare.py)
    smallshards.py  10,000 small shards from 64 clients
    footprint.py    daemon peak RSS against shard size
    drain.py        drain to POSIX (vs cp) and S3 (vs s5cmd)
    restore.py      ckptdrain restore vs cp and s5cmd
    machine.py      what the figures were measured on
"""
