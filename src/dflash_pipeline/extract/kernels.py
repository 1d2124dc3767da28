"""Opt-in flash-linear-attention Triton kernels for hybrid targets on CUDA (``extract.fla_kernels``)."""

from __future__ import annotations

import contextlib
import logging
import types

from torch import nn

log = logging.getLogger(__name__)


_FLA_NAMES = ("conv1d", "gated_norm", "rms_norm")
_ZERO_CENTRED_RMSNORMS = ("Qwen3_5RMSNorm", "Qwen3NextRMSNorm")


def _fla_conv1d_fn():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        from fla.modules.convolution import causal_conv1d
    return causal_conv1d


def use_fla_kernels(model: nn.Module, kernels=("conv1d",)) -> contextlib.ExitStack:
    """Swap flash-linear-attention Triton kernels into a hybrid target (CUDA only); returns an ExitStack
    whose ``close()`` undoes the swaps. Kernels: ``conv1d`` (the GDN short convolution: transformers'
    ``causal_conv1d_fn`` falls back to ``F.conv1d`` + SiLU without the ``causal-conv1d`` package),
    ``gated_norm`` (the GDN output's RMSNorm x SiLU(gate)) and ``rms_norm`` (the zero-centred RMSNorms,
    ``x / rms(x) * (1 + w)`` in float32). Raises if FLA is missing or the model is not on CUDA."""
    unknown = sorted(set(kernels) - set(_FLA_NAMES))
    if unknown:
        raise ValueError(f"unknown FLA kernels {unknown} (expected some of {list(_FLA_NAMES)})")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise RuntimeError(f"FLA kernels need a CUDA device, the target is on {device}")
    undo = contextlib.ExitStack()
    gdn = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if "conv1d" in kernels and gdn:
        import importlib

        fla_conv = _fla_conv1d_fn()
        for module_name in sorted({type(m).__module__ for m in gdn}):
            modeling = importlib.import_module(module_name)
            original = getattr(modeling, "causal_conv1d_fn", None)
            if original is None:
                log.warning("%s has no causal_conv1d_fn: its short convolution is left as it is", module_name)
                continue

            def conv1d(hidden_states, weight, bias=None, activation=None, _original=original, **kwargs):
                if not hidden_states.is_cuda:
                    return _original(hidden_states, weight, bias, activation=activation, **kwargs)
                # transformers passes [B, C, T] as a transposed view of the contiguous [B, T, C] projection
                out, _ = fla_conv(x=hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
                return out.transpose(1, 2)

            modeling.causal_conv1d_fn = conv1d
            undo.callback(setattr, modeling, "causal_conv1d_fn", original)
    if "gated_norm" in kernels:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        for m in gdn:
            norm = m.norm

            def forward(self, hidden_states, gate):
                return rms_norm_gated(hidden_states, gate, self.weight, None, activation="swish",
                                      eps=self.variance_epsilon).to(hidden_states.dtype)

            norm.forward = types.MethodType(forward, norm)
            undo.callback(vars(norm).pop, "forward", None)
    if "rms_norm" in kernels:
        from fla.modules.norm.layernorm import rms_norm

        for m in model.modules():
            if type(m).__name__ in _ZERO_CENTRED_RMSNORMS:
                def forward(self, x):
                    weight = self.weight.float() + 1.0  # tiny; recomputed so weight edits are seen
                    return rms_norm(x, weight, None, eps=self.eps).to(x.dtype)

                m.forward = types.MethodType(forward, m)
                undo.callback(vars(m).pop, "forward", None)
    return undo

