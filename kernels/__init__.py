"""The compile pipeline: an op call's input signature, the call traced into an
exportable module, ``torch.export``, AOTInductor, and the produced library."""

from aoti_eager.kernels.compile import Artifact, CompileError, compile_call
from aoti_eager.kernels.request import CompileRequest
from aoti_eager.kernels.signature import CallSignature, Unsupported

__all__ = ["Artifact", "CallSignature", "CompileError", "CompileRequest", "Unsupported", "compile_call"]
