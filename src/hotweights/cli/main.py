"""`hotweights` command line: prints for humans; the library only logs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from hotweights.checkpoint import MODES
from hotweights.cli.console import LOG_FORMAT
from hotweights.errors import HotweightsError
from hotweights.testing.tiny import ARCHS


def _path(text: str) -> str:
    """An argparse type: a path, not empty (an unset "$DIR" would mean the current
    directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return text


def _text(text: str) -> str:
    """An argparse type: a value, not empty (an unset "$TOKEN" would mean another token, or
    none)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty value")
    return text


class _Once(argparse.Action):
    """Store an option's value, refusing the option given twice (argparse would keep the
    last, silently: `sync --from A --from B` writing from B)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if (before := getattr(namespace, self.dest, None)) is not None:
            parser.error(f"argument {option_string}: given twice ({before} and {values}); "
                         "give it once")
        setattr(namespace, self.dest, values)


def _port(text: str) -> int:
    """An argparse type: a TCP port a server can listen on, 1 to 65535."""
    n = _count(1)(text)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"{n}: a port is 1 to 65535")
    return n


def _count(least: int):
    """An argparse type: an int >= `least`."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n}: must be {least} or more")
        return n
    return parse


class _Help(argparse.HelpFormatter):
    """argparse's, but an ``examples:`` paragraph keeps its lines as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text  # (not in the generator below: no zero-argument super)
        return "\n\n".join(
            "\n".join(indent + line for line in part.splitlines())
            if part.startswith("examples:") else fill(part, width, indent)
            for part in text.split("\n\n"))


_EXAMPLES = {  # each command's --help ends with these
    "serve": ["hotweights serve ./my-model --port 8000 --dtype bfloat16",
              "hotweights serve ./my-model --remote --port 8000   # on a server machine"],
    "status": ["hotweights status", "hotweights status --server https://gpu01:8000 "
               "--cafile ca.pem"],
    "layout": ["hotweights layout ./my-model"],
    "demo": ["hotweights demo", "hotweights demo --rl --steps 20"],
    "sync": ["hotweights sync ./ckpt --server http://127.0.0.1:8000",
             "hotweights sync ./ckpt --from ./other-ckpt --weight-version step-100",
             "hotweights sync ./ckpt --server http://127.0.0.1:8000 "
             "--changed 'model.layers.2[4-7].*'"],
    "diagnose": ["hotweights diagnose ./ckpt",
                 "hotweights diagnose ./ckpt --server http://127.0.0.1:8000 --json"],
    "recover": ["hotweights recover ./ckpt"],
}


class _Parser(argparse.ArgumentParser):
    """argparse's, whose usage errors also go to stdout as JSON under --json: a script
    reading stdout gets JSON whatever failed. (Its commands' parsers are of this class.)"""

    as_json = False  # set by `main` for the command line it parses

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if _Parser.as_json:
            print(json.dumps({"error": f"{self.prog}: {message}"}))
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    from hotweights import __version__

    parser = _Parser(
        prog="hotweights",
        description="Train an LLM in place while vLLM serves it: one copy of the weights.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show library logs")
    parser.add_argument("--version", action="version", version=f"hotweights {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="start vLLM's OpenAI server with the hotweights plugins",
        description="Start vLLM's OpenAI-compatible server on MODEL with the hotweights "
        "plugins: the weights move to shared memory (CPU) so that a trainer on this "
        "machine can train them in place through hotweights.Bridge, and /hotweights/* "
        "routes (bearer token) pause, commit and report updates. Any other flag, "
        "after MODEL, is passed to vLLM unchanged (e.g. --dtype bfloat16 --max-model-len "
        "2048), except those hotweights sets itself: --model, --worker-extension-cls, "
        "--uds, and --weight-transfer-config with --remote.",
        epilog="Memory: vLLM's CPU backend reserves 92 % of the memory node unless told, "
        "which fails beside a trainer. Unless VLLM_CPU_KVCACHE_SPACE, "
        "--gpu-memory-utilization (or --device-memory-utilization) or "
        "--kv-cache-memory-bytes is given, hotweights serve "
        "sets VLLM_CPU_KVCACHE_SPACE=4 (GiB of KV cache; CPU only): set it higher for "
        "longer contexts or more concurrent requests. The token file is written once the "
        "server answers, and removed when it stops.",
    )
    p.add_argument("model", help="model directory (or name) for vLLM")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default: 8000)")
    p.add_argument("--token", type=_text, help="access token (default: $HOTWEIGHTS_TOKEN, "
                   "else generated; prefer the variable: a command line is visible to other "
                   "users)")
    p.add_argument("--token-file", metavar="FILE", type=_path,
                   help="where to write the token, mode 0600 "
                   "(default: ~/.cache/hotweights/server-PORT.token, where clients on this "
                   "machine look for it; elsewhere, give them --token-file FILE, --token or "
                   "$HOTWEIGHTS_TOKEN)")
    p.add_argument("--remote", action="store_true", help="this server runs on another "
                   "machine than the trainer: no shared memory; it receives each update "
                   "(only what changed) from a hotweights.RemoteGroup over torch.distributed "
                   "(Gloo on CPU, NCCL on GPU), any TP size")
    p.add_argument("--ssl-keyfile", "--ssl_keyfile", metavar="FILE", help="serve https "
                   "(with --ssl-certfile): the private key (PEM, not encrypted); passed to "
                   "vLLM, checked first")
    p.add_argument("--ssl-certfile", "--ssl_certfile", metavar="FILE", help="serve https: "
                   "the certificate chain (PEM); clients check it against their CA bundle "
                   "(--cafile, HOTWEIGHTS_CA_FILE, else the system's)")
    p.set_defaults(run=_run_serve, passthrough=True)

    p = sub.add_parser(
        "status",
        help="show a server's weight version and update state",
        description="Ask a running `hotweights serve` for its weight version, whether it "
        "is paused, who holds the update lease and until when, whether the weights are "
        "dirty (an update was interrupted), and the last update's timings.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("url", nargs="?", help="the server (default: http://127.0.0.1:8000)")
    where.add_argument("--server", dest="server_flag", action=_Once, metavar="URL",
                       help="the same, as a flag (as sync and diagnose take it)")
    _client_auth(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(run=_run_status, server_flag=None)

    p = sub.add_parser(
        "layout",
        help="show how vLLM's parameters map to the HF model's",
        description="Load DIR in vLLM (in this process, CPU or GPU build) and print, "
        "for every vLLM parameter, the HF parameters it holds (rows on the split dim, "
        "HF shape); then compare a spread of rows of every HF view with the checkpoint "
        "(a vLLM loader that reorders a tensor but keeps its name and shape maps all the "
        "same: this names it). Anything unmapped or different is flagged, and the exit "
        "code is then 1.",
    )
    _model_dir(p, "a local HF model directory (config + safetensors)")
    p.add_argument("--model-impl", default="auto", choices=["auto", "vllm", "transformers"],
                   help="vLLM model implementation (default: auto)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "bfloat16", "float16", "half", "float32", "float"],
                   help="vLLM dtype (default: vLLM's auto, which loads a float32 "
                   "checkpoint in bf16 or fp16)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow custom modeling code from the model dir (auto_map)")
    p.set_defaults(run=_run_layout)

    p = sub.add_parser(
        "demo",
        help="train a tiny local model in place while vLLM serves it",
        description="Build a tiny random model locally (no download), start `hotweights "
        "serve` on it, show a completion, then teach it a phrase with a few optimizer steps "
        "through hotweights.Bridge while a client keeps generating, and show the "
        "completions and weight versions before and after: the server serves the trained "
        "weights without any copy or reload.",
    )
    p.add_argument("--arch", default="llama", choices=ARCHS, metavar="ARCH",
                   help=f"tiny model architecture: {', '.join(ARCHS)} (default: llama; "
                   "qwen3_5 needs a torchvision that imports beside the CPU torch, which "
                   "the Makefile's setup removes: docs/qwen3_5.md)")
    p.add_argument("--steps", type=_count(1), default=None,
                   help="training steps (default: 30; with --rl: 20)")
    p.add_argument("--workdir", default=None, type=_path,
                   help="where the demo writes the model, checkpoint/, server.log (and "
                   "grpo/ with --rl), kept after it: a new or empty directory, or one an "
                   "earlier demo used (default: a new temporary one)")
    p.add_argument("--rl", action="store_true", help="reinforcement learning instead: TRL's "
                   "GRPOTrainer through hotweights.integrations.trl teaches the served model "
                   "to answer in digits (reward: their share), live, while a client keeps "
                   "generating; checkpoints on the way, reloaded in plain transformers at "
                   "the end (needs the trl extra)")
    p.add_argument("--checkpoint-every", type=_count(0), default=None, metavar="K",
                   help="with --rl: write the served weights into a checkpoint every K "
                   "steps, only what changed (default: 5; 0: only at the end)")
    p.set_defaults(run=_run_demo)

    p = sub.add_parser(
        "sync",
        help="write a model's weights into a checkpoint directory, only what changed",
        description="Make the safetensors in DIR hold the weights of a running "
        "`hotweights serve` (--server) or of another checkpoint directory (--from), "
        "writing only the shards that changed (found from per-shard fingerprint sidecars "
        "in DIR/.hotweights/, else by comparing with the file; only their changed pages "
        "where the filesystem clones files or with --mode journal). With --server the server "
        "pauses (update lease, mode keep) while the live bytes are read and the changed "
        "shards staged; it resumes before they replace the files. A directory with no "
        "safetensors gets a first full save. Nothing is written if a tensor's shape or "
        "dtype differs from the file's. Exit code 1 if live tensors have no place in the "
        "checkpoint (named; the others are written).",
        epilog=_MODES_EPILOG,
    )
    _model_dir(p, "the checkpoint directory to write (model.safetensors or an index)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--server", action=_Once, metavar="URL", help="a running hotweights "
                     "serve, e.g. http://127.0.0.1:8000 (same machine)")
    src.add_argument("--from", dest="source", action=_Once, metavar="DIR", type=_path,
                     help="another safetensors checkpoint directory of the same model")
    p.add_argument("--mode", default="auto", choices=MODES,
                   help="how changed shards are written (default: auto; see below)")
    p.add_argument("--weight-version", "--version", dest="version", action=_Once,
                   metavar="TEXT", type=_text, help="with --from: the weight version "
                   "recorded in the sidecars (default: none; with --server, the server's)")
    _client_auth(p)
    p.add_argument("--convert-dtype", action="store_true",
                   help="cast float tensors of 16 bits or more to the file's float dtype "
                   "instead of refusing them (never integers or FP8; a cast that overflows "
                   "is refused)")
    p.add_argument("--changed", action="extend", nargs="+", metavar="GLOB",
                   help="only the tensors these names or glob patterns match (live names, "
                   "e.g. 'model.layers.2[4-7].*') may have changed since the last sync: the "
                   "others are not hashed where their shard's sidecar is fresh. Give only "
                   "what you know (e.g. the trainable parameters): a change outside it is "
                   "not written until a sync without --changed. Default: hash every tensor")
    p.add_argument("--json", action="store_true", help="print the result as JSON only, on "
                   "stdout (a terminal still shows the progress, on stderr)")
    p.set_defaults(run=_run_sync)

    p = sub.add_parser(
        "diagnose",
        help="check a checkpoint directory before a sync, writing nothing",
        description="Show what a sync into DIR would find: its shards and the "
        "state of their fingerprint sidecars (fresh, missing, stale or corrupt: the last "
        "three are only re-compared with the file), a committed journal not yet applied "
        "or leftovers of an interrupted sync, the filesystem and the write mode. With "
        "--server or --from, the names, shapes and dtypes of those weights are checked "
        "against the shard headers (a server is only read: no lease, it keeps serving). "
        "Exit code 1 when a problem is found.",
        epilog=_MODES_EPILOG + " diagnose writes nothing, except a probe file for "
        "reflinks, removed again.",
    )
    _model_dir(p, "the checkpoint directory to check")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--server", action=_Once, metavar="URL", help="check a running "
                     "hotweights serve's weights against it (same machine)")
    src.add_argument("--from", dest="source", action=_Once, metavar="DIR", type=_path,
                     help="check another checkpoint directory's tensors against it")
    p.add_argument("--mode", default="auto", choices=MODES,
                   help="the write mode to check (default: auto)")
    _client_auth(p)
    p.add_argument("--convert-dtype", action="store_true", help="as for sync: a float "
                   "dtype other than the file's float one is cast, not counted as a "
                   "mismatch")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON only")
    p.set_defaults(run=_run_diagnose)

    p = sub.add_parser(
        "recover",
        help="finish or drop an interrupted sync in a checkpoint directory, syncing nothing",
        description="Finish what a sync into DIR cut short (a crash, a kill, a power loss) "
        "left, and write nothing else: a committed journal is replayed, so every file it "
        "covers holds the new version; an uncommitted one is discarded with whatever was "
        "staged for it, so every file keeps the old version. Run it before anything other "
        "than hotweights (transformers, safetensors, a copy) reads a directory in which a "
        "sync may have been interrupted: hotweights diagnose says when; hotweights sync "
        "and serve run it themselves. A sync running in DIR is waited for. Exit code 1 "
        "when DIR is not a directory, or recover refuses the committed journal: its files "
        "were replaced or linked since, it is damaged or of a later version, a file it "
        "stages is lost, or this process cannot replace or write a file it covers "
        "(permissions, an immutable file); the journal is then kept.",
    )
    _model_dir(p, "the checkpoint directory")
    p.add_argument("--json", action="store_true", help='print {"outcome": "replayed" | '
                   '"discarded" | "kept" | "none", "version": the replayed sync\'s or null}')
    p.set_defaults(run=_run_recover)
    for name, p in sub.choices.items():  # -v after the command too (vLLM has no -v)
        p.set_defaults(usage_error=p.error)  # a usage error shows the command's usage
        p.epilog = "\n\n".join([*([p.epilog] if p.epilog else []), "examples:\n" + "\n".join(
            f"  {line}" for line in _EXAMPLES[name])])
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="show library logs")
    return parser


def _client_auth(p: argparse.ArgumentParser) -> None:
    """--token TOKEN or --token-file FILE, and --cafile: how a client command finds a
    server's token, and the CA bundle an https server's certificate must chain to."""
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", type=_text, help="the server's access token (default: "
                       "$HOTWEIGHTS_TOKEN, else the token file a server on this machine "
                       "wrote for its port, ~/.cache/hotweights/server-PORT.token)")
    token.add_argument("--token-file", dest="token", metavar="FILE", type=_token_file,
                       help="read the token from FILE (the --token-file the server was "
                       "started with; keeps the token off the command line)")
    p.add_argument("--cafile", metavar="PEM", help="for an https server: the CA bundle that "
                   "signed its certificate (default: $HOTWEIGHTS_CA_FILE, else the system's)")


def _token_file(path: str) -> str:
    """An argparse type: the token a file holds."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{path}: cannot read a token: "
                                         f"{getattr(e, 'strerror', None) or e}") from None
    if not text.strip():  # else the token would be looked for elsewhere
        raise argparse.ArgumentTypeError(f"{path}: empty, no token in it")
    return text


def _model_dir(p: argparse.ArgumentParser, what: str) -> None:
    """The directory of sync, diagnose, recover and layout: DIR or --model-dir DIR."""
    where = p.add_mutually_exclusive_group()  # one of them: `main` says so
    where.add_argument("model_dir", metavar="DIR", nargs="?", type=_path, help=what)
    where.add_argument("--model-dir", dest="model_dir_flag", metavar="DIR", type=_path,
                       help="the same, as a flag")
    p.set_defaults(model_dir_flag=None)


_MODES_EPILOG = (
    "Modes: reflink clones each changed shard (XFS, btrfs), patches the clone and renames "
    "it over the shard: a reader sees each shard whole, old or new. copy rewrites each "
    "changed shard whole and renames it. auto (the default): reflink where the "
    "filesystem has it, else copy, and a whole rewrite for a shard mostly changed: never "
    "a write into a file a reader may hold. journal patches the shards in place from a "
    "committed redo journal (fewer bytes on ext4): a reader during those writes may see a "
    "shard half updated (a symlinked or hard-linked shard is rewritten whole). After a "
    "crash, hotweights recover DIR (and the next sync, and hotweights serve) finishes a "
    "committed journal or drops an uncommitted one: every shard ends all old or all new."
)


def _run_serve(args: argparse.Namespace) -> int:
    from hotweights.server.serve import run

    return run(args, args.extra)


def _run_status(args: argparse.Namespace) -> int:
    from hotweights.cli.status import run

    return run(args)


def _run_layout(args: argparse.Namespace) -> int:
    from hotweights.cli.layout import run

    return run(args)


def _run_demo(args: argparse.Namespace) -> int:
    if args.checkpoint_every is not None and not args.rl:
        args.usage_error("--checkpoint-every goes with --rl (the plain demo checkpoints once, "
                         "at the end)")
    if args.rl:
        from hotweights.cli.demo_rl import run

        if args.arch != "llama":
            args.usage_error(f"--arch {args.arch} with --rl: the RL demo trains a tiny llama "
                             "(float32); leave --arch out")
        args.steps = 20 if args.steps is None else args.steps
        args.checkpoint_every = 5 if args.checkpoint_every is None else args.checkpoint_every
        return run(args)
    from hotweights.cli.demo import run

    args.steps = 30 if args.steps is None else args.steps
    return run(args)


def _run_sync(args: argparse.Namespace) -> int:
    from hotweights.cli.checkpoint import run_sync

    return run_sync(args)


def _run_diagnose(args: argparse.Namespace) -> int:
    from hotweights.cli.checkpoint import run_diagnose

    return run_diagnose(args)


def _run_recover(args: argparse.Namespace) -> int:
    from hotweights.cli.checkpoint import run_recover

    return run_recover(args)


def _check_args(args: argparse.Namespace, usage_error) -> None:
    """What argparse cannot check by itself: the checkpoint directory given one way or the
    other (`_model_dir`), a CA bundle only for an https server."""
    if hasattr(args, "server_flag"):
        args.url = args.server_flag or args.url or "http://127.0.0.1:8000"
    if hasattr(args, "model_dir_flag"):
        if args.model_dir_flag is not None:
            args.model_dir = args.model_dir_flag
        elif args.model_dir is None:
            usage_error(f"the {'model' if args.run is _run_layout else 'checkpoint'} "
                        "directory is required: DIR or --model-dir DIR"
                        + (" (every word after --changed is a pattern: put DIR before "
                           "--changed, or end the patterns with --)"
                           if getattr(args, "changed", None) else ""))
    server = getattr(args, "server", None) or getattr(args, "url", None)
    if getattr(args, "cafile", None) and isinstance(server, str) and server.strip(
            ).lower().startswith("http://"):
        usage_error(f"--cafile is for an https server; {server} is plain http (no TLS)")
    if hasattr(args, "source") and args.server is None and (
            getattr(args, "token", None) or getattr(args, "cafile", None)):
        usage_error("--token, --token-file and --cafile go with --server (a checkpoint "
                    "directory needs none of them)")
    if hasattr(args, "ssl_keyfile") and (args.ssl_keyfile is None) != (
            args.ssl_certfile is None):
        usage_error("--ssl-keyfile and --ssl-certfile go together: https needs both the "
                    "certificate chain and its private key")
    if (workdir := getattr(args, "workdir", None)) and os.path.exists(workdir) and \
            not os.path.isdir(workdir):
        usage_error(f"argument --workdir: {workdir} is not a directory (one is made where "
                    "none exists)")


def _before_model(words: list[str], model: str, extra: list[str]) -> str | None:
    """The first of vLLM's flags (`extra`) given before `serve`'s MODEL, if any: argparse
    took the word after it as the model (``serve --dtype float32 ./m``: "float32")."""
    at = words.index(model) if model in words else len(words)
    return next((w for w in words[:at] if w in extra and w.startswith("-") and "=" not in w),
                None)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    words = sys.argv[1:] if argv is None else argv
    _Parser.as_json = "--json" in words
    args, extra = parser.parse_known_args(words)
    usage_error = getattr(args, "usage_error", parser.error)
    if extra and not getattr(args, "passthrough", False):
        usage_error(f"unrecognized arguments: {' '.join(extra)}")
    if extra and (flag := _before_model(words, args.model, extra)):
        usage_error(f"vLLM's flags go after MODEL ({flag} came before {args.model!r}, "
                    "which may be its value): hotweights serve MODEL [vLLM flags]")
    args.extra = extra
    _check_args(args, usage_error)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format=LOG_FORMAT,
    )
    try:
        code = args.run(args)
        sys.stdout.flush()  # here: a reader gone is a BrokenPipeError below, not at exit
        return code
    except HotweightsError as e:
        print(f"error: {e}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading stdout gets JSON all the same
            print(json.dumps({"error": str(e)}))
        return 1
    except BrokenPipeError:  # stdout's reader left (`| head`): what was done stays done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush)
        return 128 + signal.SIGPIPE  # as a shell tells a command its pipe ended
    except KeyboardInterrupt as e:  # a sync's commit is never cut in two (`checkpoint.held`)
        said = f"interrupted: {e}" if str(e) else "interrupted"
        print(said, file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": said, "interrupted": True}))
        return 130


if __name__ == "__main__":
    sys.exit(main())
