"""A trainer process for the tests: map a server's weights, train in place, report.

Usage: python tests/trainer.py MANIFEST.json STEPS  -> one JSON line on stdout.
"""

import json
import sys

import psutil
import torch

from hotweights import build_hf_model, plan, verify_shared
from hotweights.protocol import shm

PROMPT = [1, 5, 9, 20, 33, 7, 101, 250, 64, 3]


def main(path: str, steps: int) -> dict:
    manifest = shm.Manifest.from_json(open(path).read(), source=path)
    rss = psutil.Process().memory_info().rss
    tensors = shm.attach(manifest)  # maps the server's bytes: nothing is read or copied
    layout = plan(manifest.model, tensors)
    model, report = build_hf_model(manifest.model, tensors, layout=layout,
                                   trainable=r"layers\.0\.")
    rss_growth = psutil.Process().memory_info().rss - rss
    shared = verify_shared(model, tensors, layout)
    ids = torch.tensor([PROMPT])
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.01 * p.grad.sign())  # in place, in the server's memory
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
    return dict(trainable=len(report.trainable), shared=shared, rss_growth=rss_growth,
                weight_bytes=sum(e.nbytes for e in manifest.tensors),
                logprobs=logprobs.tolist())


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
