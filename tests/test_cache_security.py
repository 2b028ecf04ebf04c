"""The node cache as a node service: a daemon run as root for a group, clients of another uid (``setpriv``), and
what a hostile local user tries: reading others' files through the daemon, squatting its socket, rewriting the
shared bytes, and credentials the daemon must not lend."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream
from tests.cache_daemon import ROOT, Daemon, remove, request
from tests.cache_daemon import places as cache_places
from tests.conftest import assert_same
from tests.other_user import NOBODY, as_user
from weightstream.errors import CacheRefusedError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"),
]

GROUP = 4242
"""The engines' group of these tests (a gid no user of this machine has)."""
MEMBER = ["--groups", str(GROUP)]


@pytest.fixture
def public(tmp_path):
    """A directory every user may enter (pytest's own are root's alone), removed after."""
    directory = Path(f"/dev/shm/wst-{secrets.token_hex(4)}")
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def group_daemon():
    """A daemon of root's serving group :data:`GROUP`."""
    directory, sock = cache_places("sec")
    try:
        with Daemon(directory, sock, "--group", str(GROUP)) as running:
            yield running
    finally:
        remove(directory, sock)


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(32, 48, generator=generator) for i in range(3)}


LOAD = textwrap.dedent("""
    import json, sys, torch, weightstream
    try:
        loaded = weightstream.load_weights(sys.argv[1], cache=sys.argv[2], **json.loads(sys.argv[3]))
    except Exception as error:
        cause = error.__cause__
        said = {"error": type(error).__name__, "message": str(error), "cause": str(cause) if cause else None}
        print(json.dumps(said))
    else:
        print(json.dumps({"sums": {name: float(tensor.double().sum()) for name, tensor in sorted(loaded.items())}}))
""")


def load_as(uid: int, uri: str, sock: Path, groups: tuple[int, ...] = (GROUP,), **options: object) -> dict:
    """What a load through the cache at ``sock`` gives a process of ``uid`` (in ``groups``)."""
    command = as_user([sys.executable, "-c", LOAD, uri, str(sock), json.dumps(options)], uid, uid, groups)
    result = subprocess.run(command, capture_output=True, text=True, cwd="/", timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def sums(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(tensor.double().sum()) for name, tensor in sorted(tensors.items())}


def test_a_group_member_gets_no_bytes_of_a_file_it_cannot_read(public, group_daemon):
    secret = public / "secret.safetensors"
    save_file(state(1), str(secret))
    secret.chmod(0o600)  # root's alone
    assert_same(weightstream.load_weights(secret, cache=str(group_daemon.socket)), state(1))  # root fills the entry
    refused = load_as(NOBODY, str(secret), group_daemon.socket)
    assert refused == {
        "error": "SourceError",
        "message": f"{secret}: cannot open: Permission denied",
        "cause": "[Errno 13] Permission denied: '" + str(secret) + "'",
    }
    shared = public / "shared.safetensors"
    save_file(state(2), str(shared))
    shared.chmod(0o644)
    assert load_as(NOBODY, str(shared), group_daemon.socket) == {"sums": sums(state(2))}
    assert_same(weightstream.load_weights(shared, cache=str(group_daemon.socket)), state(2))
    stats = request(group_daemon.socket, {"op": "stats"})
    assert (stats["fills"], stats["entries"]) == (2, 2)  # the member's fill served root: the same file, once


def test_a_client_outside_the_group_is_refused(public, group_daemon):
    shared = public / "shared.safetensors"
    save_file(state(2), str(shared))
    shared.chmod(0o644)
    refused = load_as(NOBODY, str(shared), group_daemon.socket, groups=())
    assert refused["error"] == "CacheRefusedError", refused  # a daemon is there: the user is not let in
    assert refused["message"] == (
        f"{group_daemon.socket}: a cache daemon's socket, but uid {NOBODY} may not connect (Permission denied): not "
        f"in the daemon's group (the socket is root:{GROUP}, mode 660); ask to be added to that group, or run a "
        "daemon of your own"
    ), refused
    os.chmod(group_daemon.socket, 0o666)  # opened up by mistake: the daemon still checks the group
    refused = load_as(NOBODY, str(shared), group_daemon.socket, groups=())
    assert refused["error"] == "CacheRefusedError"
    assert refused["message"] == (
        f"the cache daemon at {group_daemon.socket} serves uid 0 and group {GROUP}; this process is uid {NOBODY}"
    )


def test_a_group_member_may_not_list_evict_or_stop(public, group_daemon):
    ask = textwrap.dedent("""
        import sys
        from weightstream.nodecache.connection import CacheClient
        from weightstream.errors import CacheError
        for op in ({"op": "stop"}, {"op": "evict", "all": True}, {"op": "ls"}):
            try:
                CacheClient(sys.argv[1]).request(op)
            except CacheError as error:
                print(type(error).__name__, error)
    """)
    command = as_user([sys.executable, "-c", ask, str(group_daemon.socket)], NOBODY, NOBODY, (GROUP,))
    said = subprocess.run(command, capture_output=True, text=True, cwd="/", timeout=60, check=True).stdout
    assert said.splitlines() == [
        f"CacheRefusedError stop: only the daemon's own user (uid 0) may; this is uid {NOBODY}",
        f"CacheRefusedError evict: only the daemon's own user (uid 0) may; this is uid {NOBODY}",
        f"CacheRefusedError ls: only the daemon's own user (uid 0) may; this is uid {NOBODY}",
    ]
    assert group_daemon.process.poll() is None


WRITE_SEGMENT = textwrap.dedent("""
    import mmap, os, sys
    from weightstream.nodecache.connection import CacheClient
    answer, fds = CacheClient(sys.argv[2]).attach(sys.argv[1])
    fd = fds[0]
    for attempt, action in (
        ("fchmod", lambda: os.fchmod(fd, 0o666)),
        ("reopen", lambda: os.open(f"/proc/self/fd/{fd}", os.O_RDWR)),
        ("map", lambda: mmap.mmap(fd, answer["size"], mmap.MAP_SHARED, mmap.PROT_WRITE)),
    ):
        try:
            action()
            print(attempt, "succeeded")
        except OSError as error:
            print(attempt, error.strerror)
""")


def test_another_user_cannot_write_a_segment(public, group_daemon):
    shared = public / "shared.safetensors"
    save_file(state(3), str(shared))
    shared.chmod(0o644)
    command = as_user([sys.executable, "-c", WRITE_SEGMENT, str(shared), str(group_daemon.socket)], groups=(GROUP,))
    said = subprocess.run(command, capture_output=True, text=True, cwd="/", timeout=60, check=True).stdout
    assert said.splitlines() == ["fchmod Operation not permitted", "reopen Permission denied", "map Permission denied"]
    assert_same(weightstream.load_weights(shared, cache=str(group_daemon.socket)), state(3))


SQUATTER = textwrap.dedent("""
    import socket, struct, sys, json
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(8)
    print("listening", flush=True)
    while True:
        connection, _ = listener.accept()
        body = json.dumps({"ok": True, "key": "0" * 32, "size": 8, "version": None, "head_sha256": "0" * 64}).encode()
        connection.sendall(struct.pack(">I", len(body)) + body)
""")


def test_a_socket_squatted_by_another_user_is_refused(public, tmp_path):
    from weightstream.nodecache.connection import default_socket

    save_file(state(4), str(tmp_path / "model.safetensors"))
    squat = public / "squat"
    squat.mkdir(mode=0o777)
    squat.chmod(0o1777)  # a /tmp of its own
    path = squat / "weightstream-cache.sock"
    command = as_user([sys.executable, "-c", SQUATTER, str(path)])
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd="/") as squatter:
        try:
            assert squatter.stdout.readline().strip() == "listening"
            with pytest.raises(
                CacheRefusedError,
                match=rf"{path}: the process listening there is uid {NOBODY} \(pid \d+\), not this user \(uid 0\), "
                r"root or \$WEIGHTSTREAM_CACHE_UID: its bytes are not taken",
            ):
                weightstream.load_weights(tmp_path / "model.safetensors", cache=str(path))
        finally:
            squatter.kill()
    assert default_socket() in (
        "/run/weightstream/cache.sock",
        os.path.join(os.environ.get("XDG_RUNTIME_DIR", "-"), "weightstream-cache.sock"),
    )


def serve(*args: str) -> subprocess.CompletedProcess:
    """``weightstream cache serve ARGS`` that is expected to refuse to start (it would run until stopped)."""
    command = [sys.executable, "-m", "weightstream.cli", "cache", "serve", *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_the_daemon_never_removes_files_it_did_not_make(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    (notes / "model.safetensors").write_bytes(b"weights")
    result = serve("--dir", str(notes), "--socket", str(tmp_path / "daemon.sock"))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"weightstream: error: --dir {notes}: holds files but is not a weightstream cache directory (no "
        ".weightstream-cache); give a new or empty directory: the daemon removes what it does not recognise in its own"
    )
    assert sorted(path.name for path in notes.iterdir()) == ["model.safetensors", "todo.txt"]
    config = tmp_path / "config.yaml"
    config.write_text("a: 1")
    result = serve("--dir", str(tmp_path / "segments"), "--socket", str(config))
    assert result.returncode == 1 and config.read_text() == "a: 1"
    assert result.stderr.strip() == (
        f"weightstream: error: --socket {config}: a file that is not a socket is there; it is left alone"
    )


def test_a_second_daemon_on_the_same_directory_is_refused(tmp_path):
    directory, sock = cache_places("two")
    try:
        with Daemon(directory, sock) as first:
            save_file(state(5), str(tmp_path / "model.safetensors"))
            weightstream.load_weights(tmp_path / "model.safetensors", cache=str(sock))
            second = serve("--dir", str(directory), "--socket", str(tmp_path / "second.sock"))
            assert second.returncode == 1
            assert second.stderr.strip() == (
                f"weightstream: error: --dir {directory}: in use by the cache daemon pid {first.process.pid}; stop "
                "it first, or give another directory"
            )
            assert request(sock, {"op": "stats"})["entries"] == 1  # the first daemon's entry untouched
            assert_same(weightstream.load_weights(tmp_path / "model.safetensors", cache=str(sock)), state(5))
    finally:
        remove(directory, sock)


def test_a_file_rewritten_with_its_mtime_set_back_is_not_served_stale(tmp_path):
    import time

    path = tmp_path / "model.safetensors"
    save_file(state(6), str(path))
    directory, sock = cache_places("stale")
    try:
        with Daemon(directory, sock):
            assert_same(weightstream.load_weights(path, cache=str(sock)), state(6))
            before = path.stat()
            time.sleep(0.05)  # change times are kept at the kernel's tick
            other = state(7)  # same names and shapes: the same size
            save_file(other, str(tmp_path / "other.safetensors"))
            with open(path, "r+b") as file:
                file.write((tmp_path / "other.safetensors").read_bytes())
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
            assert_same(weightstream.load_weights(path, cache=str(sock)), other)
            assert request(sock, {"op": "stats"})["entries"] == 2
    finally:
        remove(directory, sock)


READER = {"key": "reader", "secret": "reader-secret"}
STRANGER = {"key": "stranger", "secret": "stranger-secret"}


@pytest.fixture(scope="module")
def guarded_s3(tmp_path_factory):
    """A SeaweedFS of its own whose bucket only the admin (the daemon's own credentials) and ``reader`` may read;
    ``stranger`` may list it, not read it."""
    from tests.objstore import seaweedfs

    identities = [
        {
            "name": "reader",
            "credentials": [{"accessKey": READER["key"], "secretKey": READER["secret"]}],
            "actions": ["Read:bench", "List:bench"],
        },
        {
            "name": "stranger",
            "credentials": [{"accessKey": STRANGER["key"], "secretKey": STRANGER["secret"]}],
            "actions": ["List:bench"],
        },
    ]
    with seaweedfs(tmp_path_factory.mktemp("guarded-s3"), identities) as (endpoint, _):
        yield endpoint


def guarded_object(guarded_s3: str, tmp_path: Path, key: str, tensors: dict, monkeypatch) -> str:
    """``tensors`` saved as ``key`` in the guarded bucket; its URI. The environment then holds the admin's
    credentials: the daemons started after it read with them."""
    from tests.objstore import KEYS, s3_client

    save_file(tensors, str(tmp_path / "model.safetensors"))
    client = s3_client(guarded_s3)
    try:
        client.put_object(Bucket="bench", Key=key, Body=(tmp_path / "model.safetensors").read_bytes())
    finally:
        client.close()
    for name, value in {**KEYS, "AWS_ENDPOINT_URL": guarded_s3}.items():
        monkeypatch.setenv(name, value)
    return f"s3://bench/{key}"


def test_a_remote_source_is_read_for_another_user_only_with_its_own_credentials(guarded_s3, tmp_path, monkeypatch):
    uri = guarded_object(guarded_s3, tmp_path, "guarded/model.safetensors", state(8), monkeypatch)
    directory, sock = cache_places("s3sec")
    try:
        with Daemon(directory, sock, "--group", str(GROUP)):
            assert_same(weightstream.load_weights(uri, cache=str(sock)), state(8))  # its owner: its own credentials
            member = {"AWS_ACCESS_KEY_ID": READER["key"], "AWS_SECRET_ACCESS_KEY": READER["secret"]}
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", member["AWS_ACCESS_KEY_ID"])
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", member["AWS_SECRET_ACCESS_KEY"])
            # The member's own environment lets it list; nothing in its options: the daemon lends it nothing.
            refused = load_as(NOBODY, uri, sock)
            assert refused["error"] == "CacheRefusedError"
            assert refused["message"] == (
                f"{uri}: the cache daemon reads for a client of another user only with that client's own credentials, "
                "never its own: pass key and secret (and token, if temporary) or anon=True in storage_options"
            )
            denied = load_as(NOBODY, uri, sock, storage_options=STRANGER)
            assert denied["error"] in ("SourceError", "AccessDeniedError")
            assert re.search(r"access denied \(HTTP 403 (AccessDenied|403)\)", denied["message"]), denied
            assert load_as(NOBODY, uri, sock, storage_options=READER) == {"sums": sums(state(8))}
            stats = request(sock, {"op": "stats"})
            assert (stats["fills"], stats["hits"]) == (1, 1)  # the reader was served root's fill, once it showed it may
    finally:
        remove(directory, sock)


def test_a_fleet_lends_another_user_nothing_its_own_credentials_would_not_read(guarded_s3, tmp_path, monkeypatch):
    """Through a fleet, a piece may come from a peer instead of the origin: a client of another user still gets bytes
    only once its own credentials read the origin (the daemon asks it first), never because a peer holds them."""
    pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")
    from tests.etcd_server import etcd_server

    uri = guarded_object(guarded_s3, tmp_path, "fleet/model.safetensors", state(10), monkeypatch)
    holder, server = cache_places("fleetsecholder"), cache_places("fleetsecserver")
    try:
        with etcd_server(tmp_path) as etcd:
            fleet = ("--fleet", etcd.replace("http://", "etcd://") + "/security", "--group", str(GROUP))
            with (
                Daemon(*holder, *fleet, "--fleet-node", "holder") as filled,
                Daemon(*server, *fleet, "--fleet-node", "server") as serving,
            ):
                assert_same(weightstream.load_weights(uri, cache=str(filled.socket)), state(10))  # its owner
                refused = load_as(NOBODY, uri, serving.socket)
                assert refused["error"] == "CacheRefusedError", refused
                denied = load_as(NOBODY, uri, serving.socket, storage_options=STRANGER)
                assert denied["error"] in ("SourceError", "AccessDeniedError"), denied
                assert request(serving.socket, {"op": "stats"})["fleet"]["bytes_from_peers"] == 0, "a peer's bytes lent"
                assert load_as(NOBODY, uri, serving.socket, storage_options=READER) == {"sums": sums(state(10))}
                served = request(serving.socket, {"op": "stats"})["fleet"]
                assert (served["bytes_from_origin"], served["bytes_from_peers"]) == (
                    0,
                    (tmp_path / "model.safetensors").stat().st_size,
                )
    finally:
        remove(*holder)
        remove(*server)


DAEMON_USER = 4321
"""The daemon's own user in the service deployment (no root anywhere)."""


def test_a_daemon_of_its_own_user_serves_its_group_and_clients_trust_only_the_user_named(public, monkeypatch):
    shared = public / "shared.safetensors"
    save_file(state(9), str(shared))
    shared.chmod(0o644)
    runtime = public / "run"
    runtime.mkdir(mode=0o711)
    runtime.chmod(0o711)
    os.chown(runtime, DAEMON_USER, DAEMON_USER)
    directory = Path(f"/dev/shm/wsc-own-{secrets.token_hex(4)}")
    sock = runtime / "cache.sock"
    # The daemon's user is a member of the engines' group (systemd: Group= or SupplementaryGroups=), so that it
    # may give its socket to that group.
    serve_as = lambda command: as_user(command, DAEMON_USER, DAEMON_USER, (GROUP,))
    daemon = Daemon(directory, sock, "--group", str(GROUP), wrap=serve_as)
    try:
        with daemon:
            assert directory.stat().st_uid == DAEMON_USER and sock.stat().st_uid == DAEMON_USER
            refused = load_as(NOBODY, str(shared), sock)
            assert refused["error"] == "CacheRefusedError" and f"is uid {DAEMON_USER}" in refused["message"]
            monkeypatch.setenv("WEIGHTSTREAM_CACHE_UID", str(DAEMON_USER))
            assert load_as(NOBODY, str(shared), sock) == {"sums": sums(state(9))}
            refused = load_as(0, str(shared), sock, groups=())  # root is no one special to a daemon of its own user
            assert refused["error"] == "CacheRefusedError" and "this process is uid 0" in refused["message"]
        assert daemon.process.returncode == 0
    finally:
        remove(directory, sock)


def test_a_file_uri_is_a_local_file_and_comes_as_a_descriptor_too(public, group_daemon):
    secret = public / "secret.safetensors"
    save_file(state(1), str(secret))
    secret.chmod(0o600)
    asked = textwrap.dedent("""
        import sys
        from weightstream.nodecache.connection import CacheClient
        from weightstream.errors import CacheError
        try:  # a hand-made request: a file:// URI and no descriptor
            CacheClient(sys.argv[2]).request({"op": "attach", "uri": "file://" + sys.argv[1], "storage_options": {}})
        except CacheError as error:
            print(type(error).__name__, error)
    """)
    command = as_user([sys.executable, "-c", asked, str(secret), str(group_daemon.socket)], groups=(GROUP,))
    said = subprocess.run(command, capture_output=True, text=True, cwd="/", timeout=60, check=True).stdout.strip()
    assert said == (
        f"CacheProtocolError file://{secret}: a local file comes to the cache daemon as a descriptor the client "
        "opened; 0 came with the request"
    )
    refused = load_as(NOBODY, f"file://{secret}", group_daemon.socket)
    assert refused["error"] == "SourceError" and refused["message"] == f"{secret}: cannot open: Permission denied"


O_PATH_ATTACH = textwrap.dedent("""
    import os, sys
    from weightstream.nodecache.connection import CacheClient
    from weightstream.errors import CacheError, WeightstreamError
    fd = os.open(sys.argv[1], os.O_PATH)  # needs no read permission
    message = {"op": "attach", "uri": sys.argv[1], "storage_options": {}}
    try:
        answer, fds = CacheClient(sys.argv[2]).request(message, (fd,))
        print("served", len(fds))
    except WeightstreamError as error:
        print(type(error).__name__, error)
""")


def test_a_descriptor_that_proves_no_read_access_gets_nothing(public, group_daemon):
    secret = public / "secret.safetensors"
    save_file(state(1), str(secret))
    secret.chmod(0o600)
    weightstream.load_weights(secret, cache=str(group_daemon.socket))  # root's entry for that very file
    command = as_user([sys.executable, "-c", O_PATH_ATTACH, str(secret), str(group_daemon.socket)], groups=(GROUP,))
    said = subprocess.run(command, capture_output=True, text=True, cwd="/", timeout=60, check=True).stdout.strip()
    assert said == f"UnsupportedInputError {secret}: the descriptor passed is not open for reading"


HOG = textwrap.dedent("""
    import socket, struct, sys, time
    held, refused = [], 0
    for _ in range(64):  # every slot the daemon has, each with a request that never ends
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(sys.argv[1])
        connection.sendall(struct.pack(">I", 100) + b"{")
        held.append(connection)
    time.sleep(1)
    for connection in held:
        connection.setblocking(False)
        try:
            refused += b"CacheRefusedError" in connection.recv(4096)
        except BlockingIOError:
            pass
    print(refused, flush=True)
    time.sleep(5)
""")


def test_one_user_cannot_take_every_connection(public, group_daemon, tmp_path):
    save_file(state(10), str(tmp_path / "model.safetensors"))
    command = as_user([sys.executable, "-c", HOG, str(group_daemon.socket)], groups=(GROUP,))
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd="/") as hog:
        try:
            assert hog.stdout.readline().strip() == "32"  # half the slots, the rest refused at once
            loaded = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(group_daemon.socket))
            assert_same(loaded, state(10))  # the daemon's own user still gets in
        finally:
            hog.kill()


def test_a_group_member_finds_roots_daemon_unnamed_and_an_outsider_is_told_and_reads_the_source(public):
    """``cache="auto"`` without ``$WEIGHTSTREAM_CACHE``: a member of root's daemon's group, whose own default socket
    is not there, loads through root's (``/run/weightstream/cache.sock``); a user outside the group is told, at
    WARNING, that it is not in the daemon's group, and reads the source itself."""
    from weightstream.nodecache.connection import ROOT_SOCKET

    if os.path.lexists(ROOT_SOCKET):
        pytest.skip(f"a daemon of this machine's listens at {ROOT_SOCKET}")
    shared = public / "shared.safetensors"
    save_file(state(3), str(shared))
    shared.chmod(0o644)
    made = not os.path.isdir(os.path.dirname(ROOT_SOCKET))
    os.makedirs(os.path.dirname(ROOT_SOCKET), mode=0o755, exist_ok=True)
    directory, _ = cache_places("rootsock")
    environment = {
        name: value for name, value in os.environ.items() if name not in ("WEIGHTSTREAM_CACHE", "XDG_RUNTIME_DIR")
    }
    try:
        with Daemon(directory, Path(ROOT_SOCKET), "--group", str(GROUP)):
            said = {}
            for who, groups in (("member", (GROUP,)), ("outsider", ())):
                command = as_user([sys.executable, "-c", LOAD, str(shared), "auto", "{}"], NOBODY, NOBODY, groups)
                result = subprocess.run(
                    command, capture_output=True, text=True, cwd="/", timeout=120, check=False, env=environment
                )
                assert result.returncode == 0, result.stderr[-3000:]
                said[who] = (json.loads(result.stdout.strip().splitlines()[-1]), result.stderr)
                assert said[who][0] == {"sums": sums(state(3))}, said
            stats = request(Path(ROOT_SOCKET), {"op": "stats"})
    finally:
        remove(directory, Path(ROOT_SOCKET))
        if made:
            os.rmdir(os.path.dirname(ROOT_SOCKET))
    assert stats["fills"] == 1, "the member did not load through root's daemon"
    assert stats["hits"] + stats["fills"] == 1, "the outsider loaded through the daemon"
    assert "not in the daemon's group" in said["outsider"][1] and "reading from the source" in said["outsider"][1]
