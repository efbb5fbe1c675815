"""The one place that chooses, per device, dtype and head shape, the route each piece of a prefill takes. A Runner
builds its `Routes` once (`Routes.for_model`); prefill, its chunk rows, the fill projection and the delta rule read
it, and `describe()` is what results record.

- causal: chunk attention over the cached prefix when the queries are the last nq positions (torchfill/attention.py):
  "flash" on CUDA in fp16/bf16 where torch's flash kernel takes the head shape (one call, lower-right causal,
  GQA K/V unrepeated); "lower_right" on CUDA otherwise (fp32: torch's lower-right causal bias, GQA heads repeated);
  "cpu_split" on the CPU (the CPU flash kernel over the prefix and the block, merged by log-sum-exp);
  "cudnn_split" (the cuDNN op, same split) only when asked for.
- window: the local attention of filled rows (torchfill/window.py): "flash_band" where "flash" applies (one
  sliding-window flash call, sinks merged by log-sum-exp, no host sync), else "blocks" (blocks of rows, a masked
  band each: the CPU's); "masked_band" (the band route with its exact masked stand-in) only when asked for.
- projection: the filled rows' late K/V (torchfill/projection.py): "torch" (the fused projection, one bmm) for auto
  on every device, or "layers" (per layer) when asked for.
- delta_rule: Gated DeltaNet's chunked rule (torchfill/families/delta_rule.py): "fla" on CUDA when
  flash-linear-attention imports, else "torch" (an installed fla that fails to import: one warning).

For measurement (scripts/attention_check.py, bench-ttft runs of a GPU check), the environment variable
RIDGEFILL_ROUTES overrides routes, e.g. RIDGEFILL_ROUTES="causal=cudnn_split,window=blocks"; a route the device
or the dtype cannot run (flash, flash_band and cudnn_split are fp16/bf16 only; fla where it does not import) is
refused in one line. What a GPU session must decide by measurement (bf16, the 8B shape): whether
"flash" beats "cudnn_split" (and FlexAttention, not wired here: it needs torch.compile per shape) for chunk
attention at 8K-128K keys, and whether "flash_band" beats full attention and "blocks" for the window at W = 2,048;
the defaults above are the routes expected to win and are correct by construction.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass, replace

import torch

from ridgefill.errors import RidgefillError

CAUSAL_ROUTES = ("flash", "cudnn_split", "cpu_split", "lower_right")
WINDOW_ROUTES = ("flash_band", "masked_band", "blocks")
PROJECTION_ROUTES = ("torch", "layers")
DELTA_RULE_ROUTES = ("fla", "torch")
PROJECTION_KERNELS = ("auto",) + PROJECTION_ROUTES
ENV = "RIDGEFILL_ROUTES"
CUDA_ONLY = {"flash", "cudnn_split", "flash_band", "fla"}
CPU_ONLY = {"cpu_split"}  # the CPU flash kernel (aten's _for_cpu op)
HALF_ONLY = {"flash", "cudnn_split", "flash_band"}  # flash-attention 2's and cuDNN's kernels: fp16 / bf16 only
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_applies(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether torch's CUDA flash kernel takes this head shape, unpadded and with GQA K/V as they are: asked of
    torch once (can_use_flash_attention on probe tensors; is_causal False in the probe, as bias.py asks it, since
    the check refuses is_causal with nq != n_keys although the kernel aligns it lower-right). Head dims that are not
    a multiple of 8 would need the K/V padded (a copy of the prefix), so they take another route."""
    if torch.device(device).type != "cuda" or dtype not in FLASH_DTYPES or head_dim % 8 or heads % kv_heads:
        return False
    q = torch.zeros(1, heads, 2, head_dim, device=device, dtype=dtype)
    k = torch.zeros(1, kv_heads, 4, head_dim, device=device, dtype=dtype)
    params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, False, True)  # 7th: enable_gqa
    return bool(torch.backends.cuda.can_use_flash_attention(params, False))


def delta_rule_route(device: torch.device) -> str:
    """fla's fused Gated DeltaNet kernel on CUDA when flash-linear-attention imports, else the torch rule. An fla
    that is installed but fails to import for any reason (a Triton or torch it was not built for raises
    AttributeError, RuntimeError, ...) falls back to the torch rule with one warning: it must not stop every runner,
    dense ones included."""
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError as e:
        if e.name is None or not (e.name == "fla" or e.name.startswith("fla.")):
            warnings.warn(fla_broken(e), RuntimeWarning, stacklevel=2)  # fla is there, something it imports is not
        return "torch"
    except Exception as e:  # noqa: BLE001 (any failure of a third-party import: fall back, say so)
        warnings.warn(fla_broken(e), RuntimeWarning, stacklevel=2)
        return "torch"
    return "fla"


def fla_broken(error: BaseException) -> str:
    """The one warning of an fla that does not import."""
    first = (str(error).splitlines() or [""])[0][:200]
    return (f"flash-linear-attention (fla) is installed but does not import ({type(error).__name__}: {first}): the "
            "Gated DeltaNet rule takes the torch route (slower on CUDA); reinstall fla for this torch and Triton, or "
            "uninstall it")


def projection_route(backend: str) -> str:
    """The fill projection for a requested backend: auto -> torch (the fused torch path on every device: the
    Triton kernel measured slower and less accurate on an H200 and was deleted), torch, or layers."""
    if backend not in PROJECTION_KERNELS:
        raise RidgefillError(f"projection kernel {backend!r} is not one of {', '.join(PROJECTION_KERNELS)}")
    return "torch" if backend == "auto" else backend


@dataclass(frozen=True)
class Routes:
    device: str  # "cpu", "cuda", ...
    dtype: str  # "bfloat16", ...
    causal: str
    window: str
    projection: str
    delta_rule: str

    def __post_init__(self) -> None:
        for name, allowed in (("causal", CAUSAL_ROUTES), ("window", WINDOW_ROUTES),
                              ("projection", PROJECTION_ROUTES), ("delta_rule", DELTA_RULE_ROUTES)):
            value = getattr(self, name)
            if value not in allowed:
                raise RidgefillError(f"{name} route {value!r} is not one of {', '.join(allowed)}")
            if value in CUDA_ONLY and self.device != "cuda":
                raise RidgefillError(f"{name} route {value!r} runs on CUDA only, not on {self.device}: pick one of "
                                     f"{', '.join(r for r in allowed if r not in CUDA_ONLY)}")
            if value in CPU_ONLY and self.device != "cpu":
                raise RidgefillError(f"{name} route {value!r} runs on the CPU only, not on {self.device}: pick one "
                                     f"of {', '.join(r for r in allowed if r not in CPU_ONLY)}")
            if value in HALF_ONLY and self.dtype not in ("float16", "bfloat16"):
                others = [r for r in allowed if r not in HALF_ONLY and r not in CPU_ONLY | CUDA_ONLY]
                raise RidgefillError(f"{name} route {value!r} runs in float16 or bfloat16 only, not in {self.dtype}: "
                                     f"run with --dtype bf16, or pick {' or '.join(others)} for {self.dtype}")

    @classmethod
    def for_model(cls, device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                  projection: str = "auto", overrides: str | None = None) -> "Routes":
        """The routes of a model's attention shape on `device` in `dtype`; `overrides` "name=route,..." (None:
        the RIDGEFILL_ROUTES environment variable, if set) replace the chosen ones."""
        device = torch.device(device)
        flash = flash_applies(device, dtype, heads, kv_heads, head_dim)
        if flash:
            causal = "flash"
        elif device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            causal = "cpu_split"
        else:
            causal = "lower_right"
        routes = cls(device.type, str(dtype).removeprefix("torch."), causal, "flash_band" if flash else "blocks",
                     projection_route(projection), delta_rule_route(device))
        text = os.environ.get(ENV) if overrides is None else overrides
        return routes.overridden(text) if text else routes

    def overridden(self, text: str) -> "Routes":
        """These routes with "name=route,..." replacing some (a route the device cannot run: one line)."""
        changes = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            if name.strip() not in ("causal", "window", "projection", "delta_rule") or not value.strip():
                raise RidgefillError(f"{ENV} item {item!r} is not name=route with name one of causal, window, "
                                     "projection, delta_rule")
            changes[name.strip()] = value.strip()
        routes = replace(self, **changes)
        if routes.delta_rule == "fla" and self.delta_rule != "fla" and self.device == "cuda":
            raise RidgefillError(f"{ENV} asks for delta_rule=fla but flash-linear-attention does not import here: "
                                 "install fla, or leave delta_rule out (the torch rule)")
        return routes

    def describe(self) -> dict:
        """What a result records: the device, dtype and each route."""
        return asdict(self)
