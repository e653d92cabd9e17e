"""The one error tree of hotweights: every message names the object at fault."""

import shlex
import sys
from pathlib import Path


def install(extra: str) -> str:
    """The command that installs `extra` of this hotweights for this Python: from the
    checkout it runs from where it is one (an editable install), else from the index."""
    root = Path(__file__).resolve().parents[2]
    what = f"-e {shlex.quote(f'{root}[{extra}]')}" if (root / "pyproject.toml").is_file() \
        else shlex.quote(f"hotweights[{extra}]")
    return f"{shlex.quote(sys.executable)} -m pip install {what}"


class HotweightsError(Exception):
    """Base of every error hotweights raises on bad input or a bad state."""


class LayoutError(HotweightsError):
    """A vLLM parameter and the HF model disagree (names the vLLM and the HF parameter)."""


class ManifestError(HotweightsError):
    """A manifest is malformed (names the manifest and the field)."""


class CheckpointError(HotweightsError):
    """A checkpoint shard is wrong (names the shard file and the tensor)."""


class LiveTensorError(CheckpointError):
    """A live tensor the checkpoint cannot take as it is (its dtype or shape differs from
    the file's, a cast overflows): names the tensor and the shard."""


class ServerError(HotweightsError):
    """The vLLM server refused or failed (names the route and the HTTP status); `status`:
    that status, None where no answer came (unreachable, timed out, connection broken);
    `detail`: the fields of the server's JSON answer (a refusal's `holder`), or {}."""

    def __init__(self, message: str, status: int | None = None,
                 detail: dict | None = None):
        super().__init__(message)
        self.status, self.detail = status, detail or {}


class ConfigError(HotweightsError):
    """A server option or environment hotweights cannot work with (names the flag)."""


class UnsupportedModelError(HotweightsError):
    """A model hotweights cannot train in place (names the layer or the setting at fault)."""


class FingerprintError(HotweightsError):
    """Block fingerprints are malformed or cannot be compared (names the field or tensor)."""


class DeltaError(HotweightsError):
    """A weight delta or round is malformed or does not fit its target (names tensor, field)."""


class RemoteError(HotweightsError):
    """A remote channel failed: a peer is gone, stalled or unproven (names the rank and peer);
    `no_answer`: True where it only says that servers did not answer (another try may do);
    `served`: the version the trainer's own server serves all the same, where an update
    failed only on remote servers (they stay behind until the next update), else None."""

    def __init__(self, message: str, no_answer: bool = False, served: int | None = None):
        super().__init__(message)
        self.no_answer, self.served = no_answer, served
