import asyncio, sys
import pytest
from tests.integration.test_s3_backend import *  # noqa
from tests.integration.test_s3_backend import dest_config, MiB, read_all, uploads

pytestmark = pytest.mark.filterwarnings("ignore:Sending a large body directly with raw bytes:ResourceWarning")

@pytest.mark.asyncio
async def test_dbg(seaweedfs, s3_bucket, backends, staged, proxy):
    proxy.set_rates(reset=0.1, slowdown=0.1)
    backend = backends(dest_config(s3_bucket, proxy.endpoint_url, part_size_bytes=5 * MiB,
                                   multipart_threshold_bytes=5 * MiB, max_attempts=10))
    shard = staged(40 * MiB, seed=11)
    small = staged(1 * MiB, seed=12)
    async def body():
        assert await backend.put_file("job/big", shard.fd, shard.size) == shard.checksum
        print("big done", flush=True)
        assert await backend.put_file("job/small", small.fd, small.size) == small.checksum
        print("small done", flush=True)
        for i in range(6):
            assert await backend.put_bytes(f"job/rec{i}", b"x" * i) is True
        print("recs done", flush=True)
        assert await read_all(backend, "job/big") == shard.data
        print("read done", flush=True)
    t = asyncio.create_task(body())
    done, _ = await asyncio.wait([t], timeout=20)
    if not done:
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stdout)
        for r in proxy.requests[-10:]: print(r)
        print(backend.buffers._in_use, len(backend.buffers._free), backend.buffers._slots)
        t.cancel()
        raise AssertionError("hang")
    t.result()
