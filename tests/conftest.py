import http.server
import importlib.util
import json
import os
import ssl
import threading
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub

import pytest

from hotweights.errors import install
from hotweights.testing import tiny

# Found, not imported: the trainer side and the table tests run without vLLM.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
WORKER = "hotweights.vllm_plugin.worker.HotweightsWorker"


class Engines:
    """At most one in-process vLLM engine, kept while consecutive tests ask for it.

    In-process engines cannot coexist (`local.start_engine`), and each start costs tens of
    seconds, so tests share the engine of one (arch, dtype, impl): `get` returns the running
    one for the same key and otherwise stops it and starts the next. A test that changes the
    weights restores them; one that shares them (`hotweights_share`, not undone by
    `hotweights_release`) asks for `unshared=True` and gets a fresh engine if needed.
    Every engine has the hotweights worker extension, so any test can use any engine.

    Tests parametrize `engine_key` with (arch, dtype, impl): the suite runs the tests of
    one key back to back, across modules, after every other test
    (`pytest_collection_modifyitems` below), and the engine is stopped before any test
    that does not use it (it may start its own).
    """

    def __init__(self, tiny_model):
        self._tiny_model = tiny_model
        self.key: tuple[str, str, str] | None = None
        self.llm = None
        self.shared = False

    def get(self, arch: str, dtype: str, impl: str = "auto", *, unshared: bool = False):
        key = (arch, dtype, impl)
        if key != self.key or (unshared and self.shared):
            self.close()
            from hotweights.vllm_plugin.local import start_engine

            self.llm = start_engine(self._tiny_model(arch), dtype=dtype, model_impl=impl,
                                    worker_extension_cls=WORKER)
            self.key = key
        return self.llm

    def share(self) -> dict:
        """Move the running engine's weights into shared memory; its manifest as a dict."""
        self.shared = True
        return self.llm.collective_rpc("hotweights_share")[0]

    def close(self) -> None:
        if self.llm is not None:
            from hotweights.vllm_plugin.local import stop_engine

            llm, self.llm, self.key, self.shared = self.llm, None, None, False
            stop_engine(llm)


_engines: Engines | None = None


@pytest.fixture(scope="session")
def vllm_engines(tiny_model):
    """The suite's one in-process vLLM engine at a time: `vllm_engines.get(arch, dtype, impl)`."""
    global _engines
    _engines = Engines(tiny_model)
    yield _engines
    _engines.close()
    _engines = None


def _engine_key(item):
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("engine_key") if callspec is not None else None


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by fixture parameters
def pytest_collection_modifyitems(config, items):
    if not HAVE_VLLM:
        skip = pytest.mark.skip(reason=f"vLLM is not installed ({install('cpu')})")
        for item in items:
            if item.get_closest_marker("vllm"):
                item.add_marker(skip)
    # The tests of one engine key run back to back, after every other test, and the keys of
    # vLLM's Transformers backend last: it decorates the HF classes it serves in place, for
    # good, and an HF model of such a class then builds only inside `local.hf_context`.
    keyed = [item for item in items if _engine_key(item) is not None]
    rank: dict = {}
    for item in keyed:
        key = _engine_key(item)
        rank.setdefault(key, (key[-1] != "auto", len(rank)))
    keyed.sort(key=lambda item: rank[_engine_key(item)])  # stable: module order within a key
    items[:] = [item for item in items if _engine_key(item) is None] + keyed


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # A test that does not use the shared engine may start its own: free ours first.
    if _engines is not None and "vllm_engines" not in item.fixturenames:
        _engines.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch) -> dir of a tiny random model with its tokenizer, built once."""
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str):
        return tiny.build(arch, root / arch)

    return get


@pytest.fixture(scope="session")
def servable():
    """servable(arch): skip the test unless this vLLM CPU build can serve `arch` here."""
    reasons: dict[str, str | None] = {}

    def check(arch: str) -> None:
        from hotweights.vllm_plugin.support import unservable

        if arch not in reasons:  # a failed import is retried, slowly, on every call
            reasons[arch] = unservable(arch)
        if reasons[arch]:
            pytest.skip(reasons[arch])

    return check


@pytest.fixture(scope="session")
def custom_model(tiny_model, tmp_path_factory):
    """A tiny model of a custom type whose modeling code ships in the dir (auto_map)."""
    import json
    import shutil
    from pathlib import Path

    out = tmp_path_factory.mktemp("custom") / "tiny_custom"
    shutil.copytree(tiny_model("llama"), out)
    code = Path(__file__).parent / "fixtures" / "tiny_custom" / "modeling_tiny_custom.py"
    shutil.copy(code, out)
    config = json.loads((out / "config.json").read_text())
    entry = "modeling_tiny_custom.TinyCustom"
    config.update(
        model_type="tiny_custom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={"AutoConfig": entry + "Config", "AutoModel": entry + "Model",
                  "AutoModelForCausalLM": entry + "ForCausalLM"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def without_reflinks(path) -> None:
    """Skip the calling test where `path`'s filesystem clones files (/tmp on XFS or btrfs):
    it expects what `auto` does on one that does not."""
    from hotweights.checkpoint import clone

    found, why = clone.supports_reflink(path)
    if found:
        pytest.skip(f"{why}: the test expects a filesystem without reflinks")


def remove_synced(d) -> None:
    """Remove a directory this process synced into, once nothing of those syncs runs behind
    them: `sync` returns at its commit, its finisher thread then writes the sidecars and
    its sweeper frees the trash, both in the directory; the spare clones of its shards
    closed (they hold those shards' blocks)."""
    import shutil

    from hotweights.checkpoint import finisher, spare

    finisher.finish()
    spare.release()
    shutil.rmtree(d)


@pytest.fixture(scope="session")
def xfs_dir(tmp_path_factory):
    """A loop-mounted 512 MiB XFS with reflinks (root and xfsprogs needed, else a skip).

    Shared by the session: a test makes its own subdirectory, e.g.
    `d = xfs_dir / request.node.name; d.mkdir()`.
    """
    yield from _loop_mounted(tmp_path_factory, "xfs_dir", "xfs", "-m", "reflink=1")


@pytest.fixture(scope="session")
def xfs64k_dir(tmp_path_factory):
    """As `xfs_dir`, with 64 KiB blocks, larger than a page (Linux 6.12+, else a skip):
    a clone of a range not aligned to them is a copy."""
    yield from _loop_mounted(tmp_path_factory, "xfs64k_dir", "xfs", "-m", "reflink=1", "-b",
                             "size=65536")


@pytest.fixture(scope="session")
def btrfs_dir(tmp_path_factory):
    """As `xfs_dir`, on a btrfs (btrfs-progs needed: `make` tries)."""
    yield from _loop_mounted(tmp_path_factory, "btrfs_dir", "btrfs")


def _loop_mounted(tmp_path_factory, what: str, kind: str, *options: str):
    import shutil
    import subprocess

    if os.geteuid() != 0:
        pytest.skip(f"{what}: loop-mounting a {kind} needs root")
    mkfs = shutil.which(f"mkfs.{kind}") or shutil.which(f"mkfs.{kind}", path="/usr/sbin:/sbin")
    if mkfs is None:
        pytest.skip(f"{what}: mkfs.{kind} not found (apt-get install "
                    f"{'xfsprogs' if kind == 'xfs' else 'btrfs-progs'}; `make` tries)")
    root = tmp_path_factory.mktemp("xfs")
    image, mount = root / "xfs.img", root / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(512 << 20)  # sparse: costs only what XFS writes
    for cmd in ([mkfs, "-q", *options, str(image)],
                ["mount", "-o", "loop", str(image), str(mount)]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            image.unlink()
            pytest.skip(f"{what}: `{' '.join(cmd)}` failed ({done.returncode}): "
                        f"{' '.join((done.stderr or done.stdout).split())}")
    try:
        yield mount
    finally:
        from hotweights.checkpoint import finisher, spare

        finisher.finish()
        spare.release()  # open files of the filesystem keep it busy
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        image.unlink()


@pytest.fixture(params=["numpy", "torch"])
def both_paths(request, monkeypatch):
    """`delta.encode` on CPU tensors through numpy (its CPU path), then through torch (the
    path of an accelerator's tensors)."""
    from hotweights.remote import delta

    monkeypatch.setattr(delta, "_NUMPY", request.param == "numpy")
    return request.param


class TLS:
    """A test CA (`ca`: its certificate, PEM) and server certificates it signs (`leaf`)."""

    def __init__(self, root):
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        self.root = root
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "hotweights test CA")])
        self._name = name
        cert = self._builder(name, self._key.public_key()).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True).add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False), critical=True)
        self.ca = self._write("ca.pem", cert.sign(self._key, _sha256()))

    def leaf(self, *names: str) -> tuple[str, str]:
        """(certificate, key) paths of a server certificate for `names` (DNS names or IPs)."""
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        def san(n):
            try:
                return x509.IPAddress(ipaddress.ip_address(n))
            except ValueError:
                return x509.DNSName(n)

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, names[0])])
        cert = self._builder(subject, key.public_key()).add_extension(
            x509.SubjectAlternativeName([san(n) for n in names]), critical=False).sign(
            self._key, _sha256())
        stem = "-".join(names).replace(":", "_")
        key_path = self.root / f"{stem}.key"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return self._write(f"{stem}.pem", cert), str(key_path)

    def _builder(self, subject, public_key):
        import datetime

        from cryptography import x509

        now = datetime.datetime.now(datetime.UTC)
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(self._name)
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1)))

    def _write(self, name, cert) -> str:
        from cryptography.hazmat.primitives import serialization

        (self.root / name).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(self.root / name)


def _sha256():
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


@pytest.fixture(scope="session")
def tls(tmp_path_factory):
    """A test CA: `tls.ca` (PEM path) and `tls.leaf("localhost", "127.0.0.1")` -> (cert, key)."""
    return TLS(tmp_path_factory.mktemp("tls"))


class JSONHandler(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the server's `answer` (JSON), else its route and Authorization
    header; `send_json` for subclasses."""

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_json(self.server.answer or {"route": self.path,
                                              "auth": self.headers.get("Authorization")})

    def send_json(self, answer, **headers: str) -> None:
        body = json.dumps(answer).encode()
        self.send_response(200)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def json_server():
    """json_server(cert, key, answer=None) -> the port of a local server (https with a
    certificate, else http) answering every GET with `answer` (JSON), else its route and
    Authorization header."""
    servers = []

    def start(cert=None, key=None, answer=None) -> int:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), JSONHandler)
        server.answer = answer
        if cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def load_bench(monkeypatch):
    """load_bench(name) -> the benchmark script benchmarks/<name>.py as a module (benchmarks/
    on sys.path, as when it runs)."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", bench / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load
