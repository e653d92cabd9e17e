"""`hotweights demo --rl`: GRPO with TRL on a tiny local model, trained in place while vLLM
serves it to the trainer and to an outside client at once.

The reward is the share of digits in a completion: a random model scores ~0.01, and GRPO
teaches it to answer in numbers within a few dozen steps. No download: the model and its
tokenizer are built on the spot. Every `--checkpoint-every` steps the served weights are
written into a checkpoint directory (only what changed); at the end that checkpoint is
loaded in plain transformers and answers in digits too.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

from rich.progress import Progress
from transformers import TrainerCallback

from hotweights.cli.console import make_console
from hotweights.cli.demo import (
    PROMPT,
    TOKENS,
    _Client,
    _complete,
    _stopping,
    first_checkpoint,
    quiet_transformers,
    serving,
    workdir_for,
)
from hotweights.errors import ConfigError, install
from hotweights.protocol.version import parse_version

PROMPTS = ["The answer is", "Count with me:", "My number:", "Call me at", "It costs"]


def digit_share(text: str) -> float:
    """The reward: the share of a completion's visible characters that are digits."""
    visible = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in visible) / len(visible) if visible else 0.0


def _reward(completions: list[str], **_) -> list[float]:
    return [digit_share(text) for text in completions]


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    from hotweights.bridge.client import Bridge
    from hotweights.server.serve import require_vllm
    from hotweights.testing import tiny

    require_vllm("hotweights demo --rl")
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    try:
        from datasets import Dataset
        from trl import GRPOConfig

        from hotweights.integrations.trl import GRPOTrainer
    except ModuleNotFoundError as e:
        raise ConfigError(f"hotweights demo --rl needs the trl extra, which is not "
                          f"installed (no module {e.name!r}): {install('trl')}") from None

    console = make_console()
    torch.set_num_threads(1)  # vLLM's CPU worker binds and spins its own (see demo.py)
    quiet_transformers()
    workdir = workdir_for(args.workdir, "hotweights-demo-rl-")
    with console.status(f"building a tiny random llama model (float32) in {workdir}"):
        model_dir = tiny.build("llama", workdir / "llama", dtype="float32")
    name = str(model_dir)
    with serving(console, model_dir, workdir, "--dtype", "float32", "--max-model-len", "256",
                 "--enforce-eager", "--max-num-seqs", "32", "--logprobs-mode",
                 "processed_logprobs") as (url, token):
        text, version = _complete(url, name)
        console.print(f"before  (version {version}): [bold]{PROMPT}[/bold][cyan]{text!r}[/cyan]"
                      f"  reward {digit_share(text):.2f}")

        bridge = Bridge.connect(url, token=token)
        ckpt = first_checkpoint(model_dir, workdir)
        config = GRPOConfig(
            output_dir=str(workdir / "grpo"), use_vllm=True, vllm_mode="server",
            per_device_train_batch_size=16, num_generations=8, max_completion_length=8,
            learning_rate=1e-2, lr_scheduler_type="constant", max_steps=args.steps,
            logging_steps=1, report_to="none", use_cpu=True, bf16=False,
            save_strategy="no", seed=0, disable_tqdm=True)
        data = Dataset.from_dict({"prompt": PROMPTS * (16 * args.steps // len(PROMPTS) + 1)})
        trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, args=config,
                              train_dataset=data)
        trainer.remove_callback(PrinterCallback)  # the progress bar says it for humans
        progress = _Progress(console, bridge, ckpt, args.steps, args.checkpoint_every)
        trainer.add_callback(progress)
        client = _Client(url, name)
        client.start()
        t = time.perf_counter()
        with progress, _stopping(client, last=lambda: parse_version(bridge.version)[0]):
            trainer.train()
        rewards = progress.rewards or [float("nan")]  # none logged: said as nan
        console.print(
            f"GRPO: {args.steps} steps in {time.perf_counter() - t:.0f} s, reward "
            f"{rewards[0]:.2f} -> {rewards[-1]:.2f} (best {max(rewards):.2f}); "
            f"{bridge.report.bytes_copied} weight bytes copied, server at version "
            f"{bridge.version}; meanwhile a client got {len(client.versions)} completions "
            f"over versions {min(client.versions, default=0)}.."
            f"{max(client.versions, default=0)}, {len(client.errors)} errors")
        text, version = _complete(url, name)
        console.print(f"after   (version {version}): [bold]{PROMPT}[/bold][green]{text!r}"
                      f"[/green]  reward {digit_share(text):.2f}")
        with console.status(f"checkpointing version {bridge.version} into {ckpt}"):
            result = bridge.checkpoint(ckpt)
        console.print(f"checkpoint: {result.bytes_written:,} bytes written, version "
                      f"{result.version} ({ckpt})")

    # The checkpoint is a plain Hugging Face model (float32, as served): it answers like the
    # served one. Reloaded in bf16, not float32: transformers' kernels are not vLLM's, and
    # in float32 a near tie between two greedy tokens has gone the other way
    tok = AutoTokenizer.from_pretrained(ckpt)
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = reloaded.generate(ids, max_new_tokens=TOKENS, do_sample=False,
                                pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    console.print(f"reloaded in plain transformers from {ckpt}: [bold]{PROMPT}[/bold]"
                  f"[green]{text!r}[/green]  reward {digit_share(text):.2f}")
    console.print(f"kept in {workdir}: the model, the checkpoint, the server's log")
    return 0


class _Progress(TrainerCallback):
    """The reward per step, live, and a checkpoint every `every` steps."""

    def __init__(self, console, bridge, ckpt: Path, steps: int, every: int):
        self.console, self.bridge, self.ckpt, self.every = console, bridge, ckpt, every
        self.rewards: list[float] = []
        self.bar = Progress(console=console)
        self.task = self.bar.add_task("GRPO on the served weights", total=steps)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(logs["reward"])
            self.bar.update(self.task, advance=1, description=(
                f"GRPO step {state.global_step}: reward {logs['reward']:.2f}, "
                f"version {self.bridge.version}"))

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0:
            result = self.bridge.checkpoint(self.ckpt)
            self.console.print(f"  step {state.global_step}: checkpoint, "
                               f"{result.bytes_written:,} bytes written")

    def __enter__(self) -> _Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()
