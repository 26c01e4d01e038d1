"""The load generators' connection (``RawConn`` in bench/_server.py, as bench/api.py and
bench/fleet.py use it): it sends the prebuilt request bytes and reads each answer by its
``Content-Length`` on one keep-alive connection, says when the server closes it and what its
``Retry-After`` was, and refuses what it cannot read (a chunked answer, a closed connection)
instead of counting it as answered."""

from __future__ import annotations

import asyncio
from types import ModuleType

import pytest

from ci import load_script


def _bench() -> ModuleType:
    return load_script("bench/api.py", "bench_api")


ANSWERS = [
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}",
    b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\nContent-Length: 5\r\n"
    b"Connection: close\r\n\r\nbusy!",
]


def _run(
    answers: list[bytes], requests: int, retry: list[float | None] | None = None
) -> tuple[list[object], list[bytes]]:
    bench = _bench()
    got: list[bytes] = []
    retry = [] if retry is None else retry

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
            got.append(head + await reader.readexactly(length))
            writer.write(answer)
            await writer.drain()
        writer.close()

    async def main() -> list[object]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = await bench.RawConn.open("127.0.0.1", port)
        out: list[object] = []
        try:
            for i in range(requests):
                body = b'{"a": 1}' if i % 2 else b""
                method = "POST" if body else "GET"
                head = bench._head(method, f"/x/{i}", f"127.0.0.1:{port}", body or None)
                try:
                    out.append(await conn.request(head, body))
                    retry.append(conn.retry_after)
                except (ValueError, ConnectionResetError, asyncio.IncompleteReadError) as exc:
                    out.append(type(exc))
        finally:
            conn.close()
            server.close()
            await server.wait_closed()
        return out

    return asyncio.run(main()), got


def test_answers_are_read_by_length_on_one_connection() -> None:
    retry: list[float | None] = []
    out, got = _run(ANSWERS, 2, retry)
    assert out == [(200, b"{}", False), (429, b"busy!", True)]
    assert retry == [None, 1.0]  # each answer's own Retry-After, none on the first
    token = _bench().TOKEN
    assert got[0].startswith(b"GET /x/0 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert f"Authorization: Bearer {token}".encode() in got[0]
    assert b"Content-Length" not in got[0]
    assert b"Content-Length: 8\r\n" in got[1] and got[1].endswith(b'\r\n\r\n{"a": 1}')


@pytest.mark.parametrize(
    ("answers", "error"),
    [
        (
            [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"],
            ValueError,
        ),  # fmt: skip
        ([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}"], asyncio.IncompleteReadError),
        ([], ConnectionResetError),  # the server closed before answering
    ],
)
def test_what_cannot_be_read_is_an_error_not_an_answer(
    answers: list[bytes], error: type[BaseException]
) -> None:
    out, _ = _run(answers, 1)
    assert out == [error]
