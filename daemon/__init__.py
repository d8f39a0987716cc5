"""ckptdrain daemon: stage checkpoint shards locally and drain them to Lustre or S3."""

__version__ = "0.1.0"
