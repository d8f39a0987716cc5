"""`make demo`: a 4-rank job saves 3 generations through one ckptdrain daemon.

The daemon runs on its embedded default configuration (no config file): staging and a
``file://`` destination under a local state directory, here ``.demo/``. The demo shows
``ckptdrain status`` while the daemon drains, ``ckptdrain ls`` at the end, verifies the
latest generation, and stops the daemon with SIGTERM.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckptdrain.client import Client

JOB = "demo-llama"
WORLD_SIZE = 4
STEPS = (100, 200, 300)
SHARD_BYTES = 24 << 20


def rank_main(socket_path: str, rank: int, step: int) -> None:
    client = Client(socket_path)
    payload = os.urandom(SHARD_BYTES)
    with client.generation(JOB, step, rank=rank, world_size=WORLD_SIZE) as gen:
        gen.put(f"model/rank{rank}.pt", payload)
        with tempfile.NamedTemporaryFile(prefix="optim-", dir=os.environ["DEMO_TMP"]) as f:
            f.write(payload[: SHARD_BYTES // 2])
            f.flush()
            gen.put_file(f"optim/rank{rank}.pt", f.name)


def run(cmd: list[str], env: dict[str, str]) -> None:
    print(f"\n$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, check=True)


def main() -> int:
    root = Path(".demo").resolve()
    shutil.rmtree(root, ignore_errors=True)
    runtime = Path(tempfile.mkdtemp(prefix="ckptdrain-demo-"))  # short path for the socket
    env = dict(os.environ)
    env.pop("CKPTDRAIN_CONFIG", None)
    env.update({
        "XDG_STATE_HOME": str(root / "state"),
        "XDG_RUNTIME_DIR": str(runtime),
        "CKPTDRAIN_METRICS__LISTEN": "127.0.0.1:0",
        "CKPTDRAIN_NODE_ID": "demo-node",
        "DEMO_TMP": str(runtime),
        # Paced so `ckptdrain status` below catches the drain in progress.
        "CKPTDRAIN_DRAIN__MAX_BANDWIDTH_BYTES_PER_S": str(100 << 20),
    })
    os.environ.update(env)
    exe = str(Path(sys.executable).with_name("ckptdrain"))
    socket_path = str(runtime / f"ckptdrain-{os.getuid()}.sock")
    dest = f"file://{root / 'state' / 'ckptdrain' / 'destination'}"
    log = open(root.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    print(f"starting the daemon on its embedded default (state under {root}, log in {log.name})")
    daemon = subprocess.Popen([exe, "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not Path(socket_path).exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                print(Path(log.name).read_text())
                print("the daemon did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        client = Client(socket_path)
        ctx = multiprocessing.get_context("spawn")
        for step in STEPS:
            t0 = time.perf_counter()
            procs = [ctx.Process(target=rank_main, args=(socket_path, r, step)) for r in range(WORLD_SIZE)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
                if p.exitcode != 0:
                    print(f"rank process exited {p.exitcode}", file=sys.stderr)
                    return 1
            print(f"step {step}: {WORLD_SIZE} ranks handed off {WORLD_SIZE * 1.5 * SHARD_BYTES / 2**20:.0f} MiB "
                  f"in {time.perf_counter() - t0:.2f} s", flush=True)
            if step == STEPS[-1]:
                run([exe, "status", "--socket", socket_path], env)
        for step in STEPS:
            client.wait(JOB, step, timeout_s=120)
        print(f"\nlatest committed generation of {JOB}: {client.latest(JOB)}")
        run([exe, "status", "--socket", socket_path], env)
        run([exe, "ls", dest], env)
        run([exe, "verify", dest, "--job", JOB, "--generation", "latest"], env)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        shutil.rmtree(runtime, ignore_errors=True)
    print(f"\ndaemon stopped (exit {daemon.returncode}); demo done")
    return 0 if daemon.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
