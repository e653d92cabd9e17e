"""GRPO with TRL on the weights a `hotweights serve` is serving: no second copy, no sync.

    hotweights serve ./my-model --dtype float32 --logprobs-mode processed_logprobs &
    python examples/grpo.py http://127.0.0.1:8000 --steps 20

The changes from a plain TRL script are the marked lines: import and connect a Bridge,
import GRPOTrainer from hotweights, pass `bridge=`. The policy TRL trains is the server's own
tensors; each optimizer step is served from the next request on. The reward here (the
share of digits in a completion) is one a random model can learn in a few dozen steps:
`hotweights demo --rl` runs this on a tiny model it builds itself.

Train a copy you can lose: the server's weights are the only copy, trained in place with
a high learning rate for a toy reward, and nothing is saved (`save_strategy="no"`): the
clients of that server are served each step. On one CPU machine, the trainer gets its
own cores (`torch.set_num_threads` below; docs/training.md "CPU: give the trainer its own
cores"): vLLM's CPU worker spins on the ones it binds.
"""

import argparse

import torch
from datasets import Dataset
from trl import GRPOConfig

from hotweights import Bridge  # hotweights
from hotweights.integrations.trl import GRPOTrainer  # hotweights: instead of trl's


def digits(completions: list[str], **_) -> list[float]:
    """The share of a completion's visible characters that are digits."""
    shares = []
    for text in completions:
        visible = [c for c in text if not c.isspace()]
        shares.append(sum(c.isdigit() for c in visible) / len(visible) if visible else 0.0)
    return shares


def main(url: str, steps: int = 20, token: str | None = None, output_dir: str = "grpo-out"):
    bridge = Bridge.connect(url, token=token)  # hotweights: the server's weights, mapped
    prompts = ["The answer is", "Count with me:", "My number:", "Call me at", "It costs"]
    trainer = GRPOTrainer(
        bridge=bridge,  # hotweights: train what this server serves
        reward_funcs=digits,
        train_dataset=Dataset.from_dict({"prompt": prompts * (4 * steps)}),
        args=GRPOConfig(
            output_dir=output_dir, use_vllm=True, vllm_mode="server", max_steps=steps,
            per_device_train_batch_size=16, num_generations=8, max_completion_length=8,
            learning_rate=1e-2, lr_scheduler_type="constant", bf16=False, use_cpu=True,
            logging_steps=1, save_strategy="no", report_to="none"),
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="a running hotweights serve, e.g. http://127.0.0.1:8000")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    parser.add_argument("--token", help="the server's token (default: $HOTWEIGHTS_TOKEN, "
                        "else the token file the server wrote for its port)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the cores vLLM's CPU worker does not bind (docs/training.md)
    main(args.url, args.steps, args.token)
