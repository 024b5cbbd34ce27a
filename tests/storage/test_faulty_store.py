"""The faulty store of ``tests.factories.faulty_store`` in front of moto's server, driven by the plain boto3 client:
with nothing armed, requests and answers pass unchanged (moto checks their signatures, and refuses one the proxy
alters); armed, each fault does to the client what it says it does."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, PaginationError, ReadTimeoutError, ResponseStreamingError

from tests.factories import faulty_store, s3server
from tests.factories.faulty_store import Fault, FaultyProxy

NAMESPACE = "{http://s3.amazonaws.com/doc/2006-03-01/}"
"""The namespace of S3's XML answers."""


@pytest.fixture(scope="module")
def proxy(server: s3server.Server) -> Iterator[FaultyProxy]:
    started = faulty_store.start(server.endpoint)
    yield started
    faulty_store.stop(started)


@pytest.fixture(autouse=True)
def disarmed(proxy: FaultyProxy) -> Iterator[None]:
    """Whatever a test arms is disarmed after it."""
    yield
    proxy.disarm()


@pytest.fixture
def bucket(server: s3server.Server) -> str:
    return s3server.new_bucket(server)


def client(proxy: FaultyProxy, keys: Mapping[str, str] = s3server.CREDENTIALS, **settings: Any) -> Any:
    """The plain boto3 client of the store behind ``proxy``, with timeouts and retries small enough for tests."""
    config = {"connect_timeout": 2, "read_timeout": 2, "retries": {"max_attempts": 2, "mode": "standard"}, **settings}
    return boto3.client(
        "s3",
        endpoint_url=proxy.endpoint,
        aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
        region_name=s3server.CREDENTIALS["AWS_DEFAULT_REGION"],
        config=Config(**config),
    )


def allowed_keys(server: s3server.Server) -> dict[str, str]:
    """The access keys of a new IAM user allowed everything in S3."""
    iam = boto3.client(
        "iam",
        endpoint_url=server.endpoint,
        aws_access_key_id=s3server.CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3server.CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=s3server.CREDENTIALS["AWS_DEFAULT_REGION"],
    )
    iam.create_user(UserName="writer")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="writer", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="writer")["AccessKey"]
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


@contextmanager
def signatures_checked(server: s3server.Server) -> Iterator[None]:
    """Moto checks the signature (and the policy) of every request meanwhile."""

    def checked_after(count: str) -> None:
        address = f"{server.endpoint}/moto-api/reset-auth"
        urllib.request.urlopen(urllib.request.Request(address, count.encode(), {"Content-Type": "text/plain"})).close()

    checked_after("0")
    try:
        yield
    finally:
        checked_after("inf")


def streamed_with_trailer(params: dict[str, Any], **_: Any) -> None:
    """A PutObject's body goes aws-chunked with chunked transfer encoding and a trailing checksum, as botocore sends
    it over HTTPS only."""
    params["context"]["checksum"]["request_algorithm"]["in"] = "trailer"


def test_with_nothing_armed_requests_and_answers_pass_unchanged(
    server: s3server.Server, proxy: FaultyProxy, bucket: str
) -> None:
    store = client(proxy, allowed_keys(server))
    store.meta.events.register("before-call.s3.PutObject", streamed_with_trailer)
    first = len(proxy.requests)
    head, tail = os.urandom(5 << 20), b"tail"
    with signatures_checked(server):
        store.put_object(Bucket=bucket, Key="a", Body=b"0123456789")
        ranged = store.get_object(Bucket=bucket, Key="a", Range="bytes=2-5")
        assert ranged["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert (ranged["ContentRange"], ranged["Body"].read()) == ("bytes 2-5/10", b"2345")
        assert store.head_object(Bucket=bucket, Key="a")["ContentLength"] == 10
        upload = store.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
        parts = [
            {"PartNumber": number, "ETag": store.upload_part(
                Bucket=bucket, Key="big", UploadId=upload, PartNumber=number, Body=body
            )["ETag"]}
            for number, body in ((1, head), (2, tail))
        ]  # fmt: skip
        store.complete_multipart_upload(Bucket=bucket, Key="big", UploadId=upload, MultipartUpload={"Parts": parts})
        store.copy_object(Bucket=bucket, Key="copy", CopySource={"Bucket": bucket, "Key": "big"})
        pages = store.get_paginator("list_objects_v2").paginate(Bucket=bucket, PaginationConfig={"PageSize": 1})
        assert [item["Key"] for page in pages for item in page["Contents"]] == ["a", "big", "copy"]
        deleted = store.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "a"}, {"Key": "copy"}]})
        assert sorted(item["Key"] for item in deleted["Deleted"]) == ["a", "copy"]
        assert proxy.hits == dict.fromkeys(faulty_store.KINDS, 0)
        proxy.arm(Fault("ignore-range"))
        with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
            store.get_object(Bucket=bucket, Key="big", Range="bytes=0-1")
    assert server.requests(bucket) == [f"PUT /{bucket}", *proxy.requests[first:]]
    direct = server.client()
    assert direct.get_object(Bucket=bucket, Key="big")["Body"].read() == head + tail
    assert [item["Key"] for item in direct.list_objects_v2(Bucket=bucket)["Contents"]] == ["big"]


def test_a_body_sent_chunked_reaches_moto_whole(server: s3server.Server, proxy: FaultyProxy, bucket: str) -> None:
    """Chunked transfer encoding, with and without aws-chunked content inside, as botocore streams over HTTPS."""
    store = client(proxy)
    store.meta.events.register("before-call.s3.PutObject", streamed_with_trailer)
    first = len(proxy.requests)
    body = os.urandom(3 << 20)
    store.put_object(Bucket=bucket, Key="aws-chunked", Body=body)
    connection = http.client.HTTPConnection("127.0.0.1", int(proxy.endpoint.rsplit(":", 1)[1]))
    connection.request("PUT", f"/{bucket}/chunked", body=iter([b"abc", b"", b"defg"]), encode_chunked=True)
    assert connection.getresponse().status == 200
    direct = server.client()
    assert direct.get_object(Bucket=bucket, Key="aws-chunked")["Body"].read() == body
    assert direct.get_object(Bucket=bucket, Key="chunked")["Body"].read() == b"abcdefg"
    assert proxy.requests[first:] == [f"PUT /{bucket}/aws-chunked", f"PUT /{bucket}/chunked"]


def test_hostile_names_are_listed_beside_the_stored_keys(proxy: FaultyProxy, bucket: str) -> None:
    store = client(proxy)
    store.put_object(Bucket=bucket, Key="a", Body=b"a")
    names = ("../../etc/passwd", "a&b<c>\"'", "sp ace+plus%20", "ünï/çødé", "ctl\x01\r\n")
    proxy.arm(Fault("hostile-names", names=names))
    listing = store.list_objects_v2(Bucket=bucket)
    assert [item["Key"] for item in listing["Contents"]] == ["a", *names]
    assert (listing["KeyCount"], listing["IsTruncated"]) == (1 + len(names), False)
    assert {item["Size"] for item in listing["Contents"][1:]} == {1}
    assert proxy.hits["hostile-names"] == 1


def test_hostile_names_are_xml_escaped_when_the_listing_is_not_url_encoded(proxy: FaultyProxy, bucket: str) -> None:
    """Without ``encoding-type=url`` the names are XML text; a carriage return survives as a character reference."""
    proxy.arm(Fault("hostile-names", names=("a&b<c>", "x\ry")))
    connection = http.client.HTTPConnection("127.0.0.1", int(proxy.endpoint.rsplit(":", 1)[1]))
    connection.request("GET", f"/{bucket}?list-type=2")
    answer = ElementTree.fromstring(connection.getresponse().read())
    assert [key.text for key in answer.iter(f"{NAMESPACE}Key")] == ["a&b<c>", "x\ry"]
    assert answer.findtext(f"{NAMESPACE}KeyCount") == "2"


def test_ignore_range_answers_a_ranged_read_with_the_whole_object(proxy: FaultyProxy, bucket: str) -> None:
    store = client(proxy)
    store.put_object(Bucket=bucket, Key="a", Body=b"0123456789")
    proxy.arm(Fault("ignore-range"))
    assert store.head_object(Bucket=bucket, Key="a")["ContentLength"] == 10
    answer = store.get_object(Bucket=bucket, Key="a", Range="bytes=2-5")
    assert answer["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert "ContentRange" not in answer
    assert answer["Body"].read() == b"0123456789"
    assert proxy.hits["ignore-range"] == 1


def test_answer_headers_gives_the_headers_named_instead(proxy: FaultyProxy, bucket: str) -> None:
    store = client(proxy)
    store.put_object(Bucket=bucket, Key="a", Body=b"0123456789")
    given = (("content-range", "bytes 0-1/99"), ("x-amz-meta-added", "yes"), ("ETag", None))
    proxy.arm(Fault("answer-headers", method="GET", headers=given))
    answer = store.get_object(Bucket=bucket, Key="a", Range="bytes=2-5")
    assert (answer["ContentRange"], answer["Metadata"]) == ("bytes 0-1/99", {"added": "yes"}) and "ETag" not in answer
    assert answer["Body"].read() == b"2345" and proxy.hits["answer-headers"] == 1


def test_a_cut_body_raises_when_read_and_the_next_request_goes_through(proxy: FaultyProxy, bucket: str) -> None:
    store = client(proxy)
    store.put_object(Bucket=bucket, Key="a", Body=bytes(range(256)) * 4)
    proxy.arm(Fault("cut", method="GET", match="/a", times=1, after=100))
    answer = store.get_object(Bucket=bucket, Key="a")
    assert answer["ContentLength"] == 1024
    with pytest.raises(ResponseStreamingError, match=r"IncompleteRead\(100 bytes read, 924 more expected\)"):
        answer["Body"].read()
    assert store.get_object(Bucket=bucket, Key="a")["Body"].read() == bytes(range(256)) * 4
    assert proxy.hits["cut"] == 1


def test_repeat_token_hands_out_the_same_token_forever(proxy: FaultyProxy, bucket: str) -> None:
    store = client(proxy)
    for key in ("a", "b"):
        store.put_object(Bucket=bucket, Key=key, Body=b"x")
    proxy.arm(Fault("repeat-token"))
    first = store.list_objects_v2(Bucket=bucket)
    again = store.list_objects_v2(Bucket=bucket, ContinuationToken=first["NextContinuationToken"])
    for page in (first, again):
        assert (page["IsTruncated"], page["NextContinuationToken"]) == (True, faulty_store.TOKEN)
        assert [item["Key"] for item in page["Contents"]] == ["a", "b"]
    with pytest.raises(PaginationError, match="same next token was received twice"):
        list(store.get_paginator("list_objects_v2").paginate(Bucket=bucket))
    assert f"continuation-token={faulty_store.TOKEN}" in proxy.requests[-1]
    assert proxy.hits["repeat-token"] == 4


def test_a_lost_answer_of_a_no_replace_write_makes_its_retry_fail_though_it_was_written(
    server: s3server.Server, proxy: FaultyProxy, bucket: str
) -> None:
    store = client(proxy)
    proxy.arm(Fault("lose-answer", method="PUT", match="/a", times=1))
    with pytest.raises(ClientError) as refused:
        store.put_object(Bucket=bucket, Key="a", Body=b"written", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert server.client().get_object(Bucket=bucket, Key="a")["Body"].read() == b"written"
    assert proxy.requests[-2:] == [f"PUT /{bucket}/a", f"PUT /{bucket}/a"]
    assert proxy.hits["lose-answer"] == 1


def test_failed_abort_and_complete_of_a_multipart_upload_raise(
    server: s3server.Server, proxy: FaultyProxy, bucket: str
) -> None:
    store = client(proxy)
    upload = store.create_multipart_upload(Bucket=bucket, Key="a")["UploadId"]
    etag = store.upload_part(Bucket=bucket, Key="a", UploadId=upload, PartNumber=1, Body=b"part")["ETag"]
    proxy.arm(Fault("fail", method="DELETE", match="uploadId="))
    with pytest.raises(ClientError, match="InternalError"):
        store.abort_multipart_upload(Bucket=bucket, Key="a", UploadId=upload)
    assert proxy.hits["fail"] == 3
    proxy.arm(Fault("fail", method="POST", match="uploadId=", status=503))
    with pytest.raises(ClientError, match="InternalError") as failed:
        parts = {"Parts": [{"PartNumber": 1, "ETag": etag}]}
        store.complete_multipart_upload(Bucket=bucket, Key="a", UploadId=upload, MultipartUpload=parts)
    assert failed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    direct = server.client()
    assert [item["UploadId"] for item in direct.list_multipart_uploads(Bucket=bucket)["Uploads"]] == [upload]
    assert "Contents" not in direct.list_objects_v2(Bucket=bucket)


def test_a_fault_hits_only_its_method_and_match_and_only_times_requests(proxy: FaultyProxy, bucket: str) -> None:
    store = client(proxy)
    store.put_object(Bucket=bucket, Key="a", Body=b"a")
    proxy.arm(Fault("fail", method="GET", match="/a", times=1))
    assert store.head_object(Bucket=bucket, Key="a")["ResponseMetadata"]["RetryAttempts"] == 0
    answer = store.get_object(Bucket=bucket, Key="a")
    assert (answer["ResponseMetadata"]["RetryAttempts"], answer["Body"].read()) == (1, b"a")
    assert proxy.hits["fail"] == 1


def test_drip_sends_the_body_a_byte_at_a_time(proxy: FaultyProxy, bucket: str) -> None:
    store = client(proxy)
    store.put_object(Bucket=bucket, Key="a", Body=b"abc")
    proxy.arm(Fault("drip", method="GET", delay=0.2))
    started = time.monotonic()
    answer = store.get_object(Bucket=bucket, Key="a")
    reading = time.monotonic()
    assert answer["Body"].read() == b"abc"
    finished = time.monotonic()
    assert finished - started >= 3 * 0.2
    assert finished - reading >= 2 * 0.2
    assert proxy.hits["drip"] == 1


def test_slow_headers_answer_late_or_past_the_read_timeout(proxy: FaultyProxy, bucket: str) -> None:
    store = client(proxy, read_timeout=0.5, retries={"total_max_attempts": 1})
    store.put_object(Bucket=bucket, Key="a", Body=b"a")
    proxy.arm(Fault("slow-headers", method="GET", delay=0.3))
    started = time.monotonic()
    assert store.get_object(Bucket=bucket, Key="a")["Body"].read() == b"a"
    assert time.monotonic() - started >= 0.3
    proxy.arm(Fault("slow-headers", method="GET", delay=1.0))
    with pytest.raises(ReadTimeoutError):
        store.get_object(Bucket=bucket, Key="a")
    assert proxy.hits["slow-headers"] == 1


def test_redirect_answers_307_to_elsewhere_and_moto_never_sees_the_request(proxy: FaultyProxy, bucket: str) -> None:
    other = faulty_store.elsewhere()
    try:
        store = client(proxy)
        proxy.arm(Fault("redirect", method="PUT", location=other.endpoint))
        with pytest.raises(ClientError) as raised:
            store.put_object(Bucket=bucket, Key="a", Body=b"a")
        metadata = raised.value.response["ResponseMetadata"]
        assert metadata["HTTPStatusCode"] == 307
        assert metadata["HTTPHeaders"]["location"] == f"{other.endpoint}/{bucket}/a"
        proxy.disarm()
        assert store.list_objects_v2(Bucket=bucket).get("KeyCount") == 0  # moto never saw the put
        assert other.requests == []  # botocore follows no redirect
        with pytest.raises(urllib.error.HTTPError, match="HTTP Error 404"):
            urllib.request.urlopen(urllib.request.Request(f"{other.endpoint}/x?y", b"abc", method="PUT"))
        assert other.requests == [("PUT /x?y", 3)]  # what reaches it is recorded
    finally:
        faulty_store.stop(other)


def test_drip_headers_sends_the_status_line_a_byte_at_a_time_until_disarmed(proxy: FaultyProxy, bucket: str) -> None:
    proxy.arm(Fault("drip-headers", method="GET", delay=0.05))
    host, port = proxy.endpoint.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as connection:
        connection.sendall(f"GET /{bucket}/a HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        started = time.monotonic()
        head = b"".join(connection.recv(1) for _ in range(60))
        assert time.monotonic() - started >= 60 * 0.05  # one byte at a time, past the headers' own end
        assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"\r\n\r\n" not in head
        proxy.disarm()
        rest = b""
        while chunk := connection.recv(1 << 16):
            rest += chunk
    assert (head + rest).endswith(b"\r\n\r\n") and b"X-Drip: x" in head + rest
    assert proxy.hits["drip-headers"] == 1
