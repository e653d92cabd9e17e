"""Whole syncs killed at random moments, and a plain reader during syncs, in every mode.

A child process syncs two weight states A and B into one directory, one after the other,
until it is SIGKILLed at a random moment (fingerprinting, staging, the journal, apply,
renames, sidecars). After `recover`, every shard must hold A, or every shard B; the next
sync completes. The children are forked from one process that imported torch once, so 50
kills per mode take seconds, not minutes.
"""

import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hotweights.checkpoint import journal, sync
from hotweights.testing.tiny import make_config

KILLS = 50
SYNCS = 20

ZYGOTE = """
import os, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import load_file
from hotweights.checkpoint import sync
d, states, mode, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
a, b = load_file(f"{states}/A.safetensors"), load_file(f"{states}/B.safetensors")
def say(text):  # one write per line: print's two (text, newline) interleave with a child's
    os.write(1, (text + "\\n").encode())
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        n = 0
        while limit == 0 or n < limit:
            sync(d, b if n % 2 == 0 else a, mode=mode)
            n += 1
            say(f"synced {n}")
        os._exit(0)
    say(str(pid))
    _, status = os.waitpid(pid, 0)
    say(f"ended {status}")
"""


STALL = 60  # seconds without a line from the zygote before the child's state goes to stderr
LIMIT = 480  # seconds a child may take to end before `Zygote.wait` fails


def _state(pid: int) -> str:
    """What the kernel says about a process: its state letter (D: uninterruptible, e.g. in
    I/O), where it waits (wchan) and, for root, its kernel stack."""
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return f"pid {pid}: gone from /proc"
    parts = [f"pid {pid}: state {state}"]
    for name in ("wchan", "stack"):
        try:
            text = (proc / name).read_text().strip()
        except OSError as e:
            text = f"unreadable ({e.strerror})"
        parts.append(f"{name}: {text or '-'}")
    return "; ".join(parts)


class Zygote:
    def __init__(self, d: Path, states: Path, mode: str, limit: int = 0):
        # Binary and unbuffered: `_line` splits the lines itself, so that no line waits in
        # a reader's buffer while `select` says the pipe is empty.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(d), str(states), mode, str(limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.buf = b""
        self.pid = 0

    def _line(self, timeout: float) -> str | None:
        """The zygote's next line, or None when none came in `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            assert chunk, "the zygote died"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def fork(self) -> int:
        self.proc.stdin.write(b"go\n")
        line = self._line(LIMIT)
        assert line is not None, f"the zygote did not fork in {LIMIT} s"
        self.pid = int(line)
        return self.pid

    def wait(self) -> list[str]:
        """The child's lines until it ended. When no line came for STALL seconds, the
        child's state goes to stderr; after LIMIT seconds, a failure that says it. (Each
        line is one write: a child killed between `print`'s text and its newline once ran
        its line into the zygote's "ended", which this then waited for in vain.)"""
        lines, started = [], time.monotonic()
        while True:
            waited = time.monotonic() - started
            line = self._line(min(STALL, LIMIT - waited))
            if line is None:
                waited = time.monotonic() - started
                state = _state(self.pid)
                print(f"child still running after {waited:.0f} s: {state}", file=sys.stderr,
                      flush=True)
                assert waited < LIMIT, f"the child did not end in {LIMIT} s: {state}"
            elif line.startswith("ended"):
                return lines
            else:
                lines.append(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still waiting for a child that does not end
            self.proc.kill()
            raise


@pytest.fixture
def states(tmp_path):
    """A tiny sharded bf16 model as A (on disk) and B (rows changed in every shard, one
    shard changed whole so that auto mode rewrites it), and each shard's bytes in both."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama", 300), dtype=torch.bfloat16)
    a = {n: t.detach().clone() for n, t in model.state_dict().items()}
    b = {n: t.clone() for n, t in a.items()}
    for t in b.values():
        if t.dim() == 2:
            t[0] += 1.0
    b["model.layers.1.mlp.down_proj.weight"] += 1.0
    side = tmp_path / "states"
    side.mkdir()
    save_file(a, side / "A.safetensors")
    save_file(b, side / "B.safetensors")
    return model, a, b, side


def _place(request, tmp_path) -> Path:
    if request.param == "xfs":
        root = request.getfixturevalue("xfs_dir") / request.node.name
        root.mkdir()
        return root
    return tmp_path


def _expected(d: Path, model, a, b, mode) -> dict[str, dict[str, bytes]]:
    model.save_pretrained(d, max_shard_size="200KB")
    sync(d, b, mode=mode)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) > 2
    new = {s: (d / s).read_bytes() for s in shards}
    sync(d, a, mode=mode)
    return {"A": {s: (d / s).read_bytes() for s in shards}, "B": new}


def _version(d: Path, expected) -> str:
    """'A' or 'B' when every shard is that version; fails on a torn shard or a mix."""
    seen = set()
    for s, old in expected["A"].items():
        data = (d / s).read_bytes()
        assert data in (old, expected["B"][s]), f"{s} is torn"
        seen.add("A" if data == old else "B")
    assert len(seen) == 1, f"shards mix versions: {seen}"
    return seen.pop()


MODES = [("ext4", "journal"), ("ext4", "copy"), ("ext4", "auto"), ("xfs", "reflink")]


@pytest.fixture
def place(request, tmp_path):
    return _place(request, tmp_path)


# A SIGKILLed child ends only when the kernel is done with its I/O, which on the loop-mounted
# XFS of a loaded CI machine can take minutes: Zygote.wait waits up to LIMIT seconds.
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("place", "mode"), MODES, indirect=["place"])
def test_sigkill_at_random_moments_leaves_one_whole_version(place, mode, states):
    model, a, b, side = states
    d = place / "model"
    expected = _expected(d, model, a, b, mode)
    started = time.perf_counter()
    sync(d, b, mode=mode)
    sync(d, a, mode=mode)
    per_sync = (time.perf_counter() - started) / 2
    rng, seen = random.Random(7), []
    zygote = Zygote(d, side, mode)
    try:
        for _ in range(KILLS):
            pid = zygote.fork()
            time.sleep(rng.uniform(0, 3 * per_sync))
            os.kill(pid, signal.SIGKILL)
            zygote.wait()
            journal.recover(d)
            seen.append(_version(d, expected))
            assert not (d / journal.STAGE_DIR).exists()
            assert not (d / journal.JOURNAL_NAME).exists()
    finally:
        zygote.close()
    final = sync(d, b, mode=mode)  # the next sync completes
    assert _version(d, expected) == "B" and final.bytes_written > 0 or seen[-1] == "B"
    assert sync(d, b, mode=mode).bytes_written == 0


@pytest.mark.parametrize(("place", "mode"), [("ext4", "auto"), ("xfs", "auto"),
                                             ("ext4", "journal")], indirect=["place"])
def test_a_plain_reader_never_sees_a_torn_shard(place, mode, states):
    """A reader that reads the shards in a loop during 20 syncs: in the default mode
    (whole rewrites on ext4, reflinks on XFS) every shard it reads is one whole version.
    (Shards it reads one after the other can be of two consecutive versions when a commit
    falls between them: see docs/checkpoint.md. In journal mode, a read during apply can
    see some blocks new: counted, not failed.)"""
    model, a, b, side = states
    d = place / "model"
    expected = _expected(d, model, a, b, mode)
    counts = {"loads": 0, "torn": 0, "mixed": 0}
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            versions = set()
            for s, old in expected["A"].items():
                data = (d / s).read_bytes()
                if data not in (old, expected["B"][s]):
                    counts["torn"] += 1
                versions.add(data == old)
            counts["loads"] += 1
            counts["mixed"] += len(versions) > 1

    reader = threading.Thread(target=read)
    reader.start()
    zygote = Zygote(d, side, mode, limit=SYNCS)
    try:
        zygote.fork()
        assert len(zygote.wait()) == SYNCS
    finally:
        done.set()
        reader.join()
        zygote.close()
    print(f"{mode}: {counts}")
    assert counts["loads"] > SYNCS
    if mode != "journal":
        assert counts["torn"] == 0, counts
    assert _version(d, expected) == "A"
