"""`hotweights sync`, `diagnose` and `recover`: a checkpoint directory, for humans."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from hotweights.checkpoint.result import not_a_directory
from hotweights.errors import CheckpointError, LiveTensorError

_PHASES = {"hash": "hashing", "write": "writing"}
_SHOWN = 5  # names listed of each kind
_LISTED = 10  # problems listed


def run_sync(args: argparse.Namespace) -> int:
    from hotweights.checkpoint import finisher, journal
    from hotweights.checkpoint.shards import read_dir

    if args.version is not None and args.source is None:
        args.usage_error("--weight-version goes with --from: with --server, the server's version "
                         "is recorded")
    created, commits = not os.path.lexists(args.model_dir), journal.commits
    config = _read(Path(args.model_dir) / "config.json")  # what a first save may replace
    try:
        with (_progress(sys.stderr.isatty()) as progress,  # on stderr: not in the JSON
              _said_below(args, "hotweights.checkpoint.incremental")):
            if args.source is not None:
                result = _sync_from(args, progress)
            else:
                from hotweights.bridge.client import Bridge

                # The lease pauses the server while the live bytes are read and staged.
                bridge = Bridge.connect(args.server, token=args.token, cafile=args.cafile)
                model = bridge.model(check_loaded=False)  # what it serves, as is
                changed = (None if args.changed is None
                           else _expand(args.changed, model.state_dict()))
                result = bridge.checkpoint(args.model_dir, exclusive=True, mode=args.mode,
                                           convert_dtype=args.convert_dtype,
                                           progress=progress, changed=changed)
        with _status(sys.stderr.isatty(), "fsync: making the commit durable"):  # (stderr)
            finisher.finish()  # the command ends with the files fsync'd, the journal removed
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupted(args.model_dir, journal.commits > commits)
                                ) from None
    if why := journal.not_durable(args.model_dir):
        raise CheckpointError(f"{args.model_dir}: the files hold this sync, but it could not "
                              f"be made durable ({why}): its journal is kept; run hotweights "
                              f"recover {shlex.quote(str(args.model_dir))} once the cause is "
                              "fixed")
    if result.dirty:
        print(f"warning: {args.model_dir}: the server serves a dirty version, "
              f"{result.version} ({result.dirty}): the weights written may be half updated",
              file=sys.stderr)
    error = None
    if lost := result.missing_on_disk:  # written all else, but a script must not go on
        total = _n(result.tensors_synced + len(lost), "live tensor")
        error = (f"{args.model_dir}: {len(lost)} of the {total} not written, no shard holds "
                 f"them: {_sample(lost)} (the wrong directory, or another model's?)")
    if args.json:  # the result, and the error as any command's (`cli.main`)
        print(json.dumps({**json.loads(result.to_json()), **({"error": error} if error
                                                             else {})}))
    else:
        disk = read_dir(args.model_dir) or {}
        if created:  # a mistyped DIR would be made silently
            print(f"created {args.model_dir}")
        rows = sync_rows(result, disk)
        if result.first_save:
            rows += _first_save_rows(Path(args.model_dir), config)
        for key, value in rows:
            print(f"  {key:<16}{value}" if key else value)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf")  # other formats' files


def _first_save_rows(model_dir: Path, config: bytes | None) -> list[tuple[str, str]]:
    """What a first save changed or left beside it: a config.json it replaced, weights of
    another format (loaders take the safetensors first)."""
    out = []
    if config is not None and _read(model_dir / "config.json") != config:
        out.append(("config.json", "replaced by the saved model's"))
    if others := sorted(p.name for g in _OTHER_WEIGHTS for p in model_dir.glob(g)):
        out.append(("left as is", f"{_sample(others)}: weights in another format "
                    "(transformers and vLLM load the safetensors)"))
    return out


def _open_source(src: Path):
    """`source.open_dir(src)`, refused while a committed journal there may leave a shard
    half written: a sync into it committing now, or one cut short (`recover` ends it)."""
    from hotweights.checkpoint import journal, lock
    from hotweights.checkpoint.source import open_dir

    if src.is_dir() and journal.pending(src) is not None:
        if lock.held(src):
            raise CheckpointError(f"{src}: a sync into it is committing now: read it once "
                                  "that sync is done")
        raise CheckpointError(
            f"{src}: a sync into it was cut short after its commit (its journal is there): "
            f"some shards may be half written; run hotweights recover {shlex.quote(str(src))} "
            "first")
    return open_dir(src, strict=True)  # a tensor two shards hold: which copy is it?


def _interrupted(model_dir: str, committed: bool) -> str:
    """What an interrupted sync left in `model_dir` (its commit is atomic: every shard as
    before or as this sync wrote it), once what it committed is durable."""
    from hotweights.checkpoint import finisher, journal

    finisher.finish()
    if journal.pending(model_dir) is not None:
        return (f"{model_dir}: the sync is committed but not applied or not durable: run "
                f"hotweights recover {shlex.quote(str(model_dir))} (or sync again) before "
                "reading it")
    if committed:
        return f"{model_dir} holds this sync, whole"
    return f"{model_dir} is as it was: nothing was written"


def _sync_from(args: argparse.Namespace, progress):
    from hotweights.checkpoint import sync

    src, dst = Path(args.source), Path(args.model_dir)
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise CheckpointError(f"{dst}: --from and the directory to write are the same one")
    tensors = _open_source(src)
    if not tensors:
        raise CheckpointError(f"--from {src}: holds no tensors (its safetensors are empty); "
                              f"nothing was written to {dst}")
    def read() -> None:
        if changed := tensors.changed():
            raise CheckpointError(
                f"{changed}: changed while this sync read it (another sync into {src}?): "
                f"{dst} may hold a mix of its versions; sync again once {src} is still")
    try:
        return sync(dst, tensors, mode=args.mode, version=args.version,
                    convert_dtype=args.convert_dtype, changed=_expand(args.changed, tensors),
                    config=_config_of(src), progress=progress,
                    after_read=read)
    except LiveTensorError as e:  # say whose the live tensors are
        raise LiveTensorError(f"{e} (the live tensors: --from {src})") from e
    finally:
        tensors.close()


def _expand(patterns: list[str] | None, live) -> list[str] | None:
    """The live names `--changed`'s glob patterns match (each must match one), or None."""
    from hotweights.checkpoint.names import matching

    return None if patterns is None else sorted(matching(live, patterns, "--changed"))


def sync_rows(result, disk: dict) -> list[tuple[str, str]]:
    """What `sync` prints, line by line; `disk` is `read_dir` of the synced directory."""
    shards = {shard.path: shard.size for shard, _ in disk.values()}
    files = sum(shards.values())
    written = result.bytes_written
    share = f" ({100 * written / files:.2f} %)" if files else ""
    out = [("", f"synced {_n(result.tensors_synced, 'tensor')} in {result.seconds:.2f} s"
            + ("" if result.version is None else f", version {result.version}"))]
    if result.first_save:
        out.append(("mode", f"first full save ({result.reason})"))
        out.append(("written", f"{_size(written)} in {_n(len(shards), 'shard')}"))
    else:
        used = result.write_mode or result.mode
        if result.write_mode and result.write_mode != result.mode:
            used += f" (asked {result.mode})"
        out.append(("mode", f"{used}: {result.reason}" if result.reason else used))
        out.append(("written", f"{_size(written)} of the shards' {_size(files)}{share}"))
        writes = [f"{name} ({how})" for name, how in sorted(result.writes.items())]
        out.append(("shards changed", f"{len(result.shards_changed)} of {len(shards)}"
                    + (f": {_sample(writes)}" if writes else "")))
        out.append(("tensors changed", f"{result.tensors_changed} of {result.tensors_synced}"))
        if result.bytes_trusted:
            out.append(("not hashed", f"{_size(result.bytes_trusted)} outside --changed, "
                        "taken as unchanged (their sidecars are fresh)"))
    if result.missing_on_disk:
        out.append(("not on disk", f"{_n(len(result.missing_on_disk), 'live tensor')} with "
                    f"no place in the checkpoint: {_sample(result.missing_on_disk)}"))
    if result.missing_live:
        out.append(("no live source", f"{_n(len(result.missing_live), 'checkpoint tensor')} "
                    f"kept as before: {_sample(result.missing_live)}"))
    if result.tied:
        out.append(("tied", f"{_n(len(result.tied), 'live alias', 'live aliases')} stored once: "
                    f"{_sample(result.tied)}"))
    return out


def _config_of(src: Path) -> dict | None:
    """The config.json of the `--from` directory, if it holds one: a first save copies it,
    and the model type in it says how a state dict's names convert (fused MoE experts)."""
    config = None
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((src / "config.json").read_text())
    return config if isinstance(config, dict) else None


def run_diagnose(args: argparse.Namespace) -> int:
    from hotweights.checkpoint import diagnose

    live, source, config = None, None, None
    if args.source is not None:
        live = source = _open_source(Path(args.source))
        config = _config_of(Path(args.source))
    elif args.server is not None:
        from hotweights.bridge.client import Bridge

        # Only names, shapes and dtypes are read: no lease, the server keeps serving.
        live = Bridge.connect(args.server, token=args.token, cafile=args.cafile).model(
            check_loaded=False)
    try:
        found = diagnose(args.model_dir, live, mode=args.mode, convert_dtype=args.convert_dtype,
                         config=config)
    finally:
        if source is not None:
            source.close()
    if args.json:
        print(found.to_json())
    else:
        for key, value in diagnose_rows(found):
            print(f"  {key:<16}{value}" if key else value)
    return 1 if found.problems else 0


def run_recover(args: argparse.Namespace) -> int:
    from hotweights.checkpoint import journal
    from hotweights.checkpoint.lock import locked

    d = args.model_dir
    if not os.path.isdir(d):
        raise not_a_directory(d)
    with locked(d):  # a sync running there ends first
        try:
            meta = journal.pending(d)  # what a committed journal brings, for the line below
            with _status(sys.stderr.isatty(), "recovering"), _said_below(
                    args, "hotweights.checkpoint.journal"):
                outcome = journal.recover(d, lock=False)
        except CheckpointError as e:  # e.g. the files were replaced since the commit
            kept = "" if re.search(r"\b(journal|it) is kept\b", str(e)) else \
                ", its journal is kept"
            raise CheckpointError(f"{d}: cannot finish the interrupted sync{kept}: {e}") from e
        except OSError as e:
            raise CheckpointError(f"{d}: cannot recover: {e}") from e
    if args.json:
        print(json.dumps({"outcome": outcome, "version": (meta or {}).get("version")}))
    else:
        print(_recover_line(d, outcome, meta))
    return 0


def _recover_line(directory: str, outcome: str, meta: dict | None) -> str:
    """What `recover` prints for `journal.recover`'s outcome; `meta`: the committed
    journal's, read before it was replayed."""
    if outcome == "replayed":
        version = (meta or {}).get("version")
        return (f"{directory}: replayed an interrupted sync"
                + ("" if version is None else f" (version {version})")
                + ": the files hold what it wrote")
    if outcome == "discarded":
        return f"{directory}: discarded an uncommitted sync: the files are as before it"
    if outcome == "kept":
        return (f"{directory}: an uncommitted sync's leftovers are there, which this process "
                "cannot remove (a read-only directory?): the files are as before it; run "
                "hotweights recover where it can write to remove them")
    return f"{directory}: nothing to recover"


def diagnose_rows(d) -> list[tuple[str, str]]:
    """What `diagnose` prints, line by line (key "" for a line of its own)."""
    out = [("", d.model_dir),
           ("filesystem", f"{d.fs_type} at {d.mount}" if d.mount else d.fs_type),
           ("write mode", f"{d.write_mode} (asked {d.mode}: {d.write_reason})"
            if d.write_mode else f"none: {d.write_reason}")]
    if d.writer_active:
        out.append(("journal", "not looked at: a sync holds the directory now, and its "
                    "journal and staged files are its own (diagnose again once it ends)"))
    elif d.journal_refused:
        out.append(("journal", "committed, and recover refuses it (see below)"))
    elif d.journal is not None:
        version = d.journal.get("version")
        out.append(("journal", "committed, not applied"
                    + ("" if version is None else f" (version {version})")))
    else:
        out.append(("journal", "none pending"))
    for line in d.leftovers:
        out.append(("leftover", line))
    if d.interrupted and not d.journal_refused:
        recover = f"hotweights recover {shlex.quote(d.model_dir)}"
        out.append(("reader", f"run {recover} before loading the shards: a sync was "
                    "interrupted, a shard may be half written" if d.journal is not None else
                    "the shards are whole, as before a sync that was interrupted before its "
                    f"commit; {recover} (or the next sync) removes what it left"))
    if d.error:
        out.append(("checkpoint", f"unreadable: {d.error}"))
    elif d.first_save:
        out.append(("checkpoint", "no safetensors yet: a sync makes a first full save"))
    else:
        out.append(("checkpoint", f"{_n(len(d.shards), 'shard')}, {_n(d.tensors, 'tensor')}, "
                    f"{_size(d.model_bytes)}"))
        width = max(len(s.name) for s in d.shards) if d.shards else 0
        for s in d.shards:
            about = [] if s.version is None else [f"version {s.version}"]
            if s.unused:  # it names the kind or block size a sync would not use
                about.append(s.unused)
            elif s.kind is not None:
                about.insert(0, s.kind)
            out.append(("", f"    {s.name:<{width}}  {_size(s.size):>10}  "
                        f"{s.tensors:>4} tensors  sidecar {s.sidecar}"
                        + (f" ({'; '.join(about)})" if about else "")))
        if unfresh := [s for s in d.shards if s.sidecar != "fresh"]:
            out.append(("note", f"{_n(len(unfresh), 'sidecar')} not fresh: the next sync "
                        "compares those shards with the live weights byte by byte (slower "
                        "once, then fresh again); nothing to fix"))
    if d.live:
        if d.names_error and not (d.matched or d.only_live):  # why: under "problems"
            out.append(("live", "names not placed (see problems)"))
        else:
            out.append(("live", f"{d.matched} matched, {d.only_live} only live, "
                        f"{d.only_disk} only on disk, {d.tied} tied"))
        if d.only_live:
            out.append(("", f"    only live: {_sample(d.only_live_samples, d.only_live)}"))
        if d.only_disk:
            out.append(("", f"    only on disk: {_sample(d.only_disk_samples, d.only_disk)}"))
    problems = d.problems
    out.append(("", "problems:" if problems else "no problems"))
    out += [("", f"  - {p}") for p in problems[:_LISTED]]
    if len(problems) > _LISTED:
        out.append(("", f"  and {len(problems) - _LISTED} more (--json lists them all)"))
    return out


def _sample(names: Sequence[str], total: int | None = None) -> str:
    total = len(names) if total is None else total
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {total - _SHOWN} more" if total > _SHOWN else "")


def _n(count: int, word: str, words: str | None = None) -> str:
    """"1 shard", "2 shards"."""
    return f"{count} {word if count == 1 else words or word + 's'}"


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"


@contextlib.contextmanager
def _said_below(args: argparse.Namespace, module: str) -> Iterator[None]:
    """The warnings of `module` left out while the block runs, unless -v: what the command
    prints once it returns says the same (a sync's tensors with no place, a recovery)."""
    if args.verbose:
        yield
        return
    log = logging.getLogger(module)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _status(enabled: bool, what: str) -> Iterator[None]:
    """A spinner saying `what` on stderr while the block runs (a terminal only)."""
    if not enabled:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(what):
        yield


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator:
    """A `sync` progress callback drawing one rich bar per phase on stderr, or None."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description:<8}"), BarColumn(),
                  DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(_PHASES.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done, total=total)

        yield update
