"""The ``s3://`` round trip against a real bucket, when one is named: ``OPTIM_REPAIR_S3_TEST_PREFIX=s3://BUCKET/PREFIX/``
with credentials as the AWS CLI finds them. Everything it writes is under a prefix of its own, deleted after."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from optim_repair import api
from optim_repair.storage.schemes import parse_url
from tests.factories import dcp as dk

NAMED = os.environ.get("OPTIM_REPAIR_S3_TEST_PREFIX", "")

pytestmark = pytest.mark.skipif(
    not NAMED, reason="no real bucket named: set OPTIM_REPAIR_S3_TEST_PREFIX=s3://BUCKET/PREFIX/ and AWS credentials"
)


def test_a_dcp_checkpoint_in_a_real_bucket_is_inspected_repaired_and_resumes(tmp_path: Path) -> None:
    url = parse_url(NAMED)
    client = boto3.client("s3")
    run = f"{url.prefix}optim-repair-test-{uuid.uuid4().hex[:12]}/"
    built = dk.sharded_dcp(tmp_path / "in")
    try:
        for path in sorted(built.path.iterdir()):
            client.put_object(Bucket=url.bucket, Key=f"{run}in/{path.name}", Body=path.read_bytes())
        diagnosis = api.inspect(f"s3://{url.bucket}/{run}in/")
        assert diagnosis.verdict == "repairable"
        assert diagnosis.inventory.traffic is not None and diagnosis.inventory.traffic.requests <= 2 + 2
        result = api.fix(f"s3://{url.bucket}/{run}in/", f"s3://{url.bucket}/{run}out/")
        assert result.verification.proof in ("S3 CRC32", "S3 ETag (MD5)")
        local = tmp_path / "out"
        local.mkdir()
        for item in client.list_objects_v2(Bucket=url.bucket, Prefix=f"{run}out/")["Contents"]:
            target = local / item["Key"][len(f"{run}out/") :]
            target.write_bytes(client.get_object(Bucket=url.bucket, Key=item["Key"])["Body"].read())
        resumed, reference = dk.resume(local, "adamw", "optim", False), dk.uninterrupted("adamw")
        assert all(torch.equal(resumed[name], reference[name]) for name in reference)
    finally:
        listed = client.list_objects_v2(Bucket=url.bucket, Prefix=run).get("Contents", [])
        if listed:
            client.delete_objects(Bucket=url.bucket, Delete={"Objects": [{"Key": item["Key"]} for item in listed]})
