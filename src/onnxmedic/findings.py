"""Findings: what onnxmedic found, with a stable code, where, and what to do next.

Codes are stable (other tools match on them) and documented in docs/findings.md; the catalogue
below is the single source of truth and a test keeps the document in step with it.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Severity(str, enum.Enum):
    """How bad a finding is. ``error`` findings make the result not ok."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True)
class CodeInfo:
    title: str
    exit_code: int  # what the CLI exits with when this is the deciding error
    doc: str


# code -> (title, exit code, one-line documentation). Exit 1: a problem with the user's model or
# input; 2: bad command-line usage; 3: an internal error of onnxmedic.
CODES: dict[str, CodeInfo] = {
    # OM0xx: inputs, usage and onnxmedic itself
    "OM001": CodeInfo("model file not found", 1, "The model spec names a file that does not exist."),
    "OM002": CodeInfo(
        "model spec names nothing", 1,
        "The module or attribute named by the model spec cannot be imported or found.",
    ),
    "OM003": CodeInfo(
        "not a model", 1,
        "The attribute is not an nn.Module, a class with a no-argument constructor, a factory "
        "function returning a module, or an ExportedProgram.",
    ),
    "OM004": CodeInfo(
        "malformed spec", 2,
        "A model, input or dynamic-shape spec on the command line cannot be parsed.",
    ),
    "OM005": CodeInfo(
        "input file unusable", 1,
        "An input file (.npz, .pt, make_inputs function) is missing, unreadable, unsafe "
        "(a pickle carrying code) or returns something that is not tensors.",
    ),
    "OM006": CodeInfo(
        "output not writable", 1,
        "The output or report path cannot be written (missing folder, no permission).",
    ),
    "OM007": CodeInfo(
        "ONNX file unreadable", 1,
        "The ONNX file given is missing, truncated, corrupt or not ONNX at all.",
    ),
    "OM008": CodeInfo(
        "inputs do not match the ONNX model", 1,
        "The inputs given do not fit the ONNX model's inputs (count, dtype or rank).",
    ),
    "OM009": CodeInfo(
        "internal error", 3,
        "onnxmedic itself failed; the traceback is kept in the report. Please file a bug.",
    ),
    "OM010": CodeInfo(
        "output not written", 1,
        "The model was not verified, so the output file was not written (or kept unchanged).",
    ),
    "OM011": CodeInfo(
        "model switched to eval mode", 0,
        "The model was in training mode; onnxmedic exported and verified it in eval mode "
        "(dropout off, batch-norm running statistics) and restored afterwards the mode of each "
        "submodule as it was (a submodule left in eval under a root in train stays in eval).",
    ),
    "OM012": CodeInfo(
        "the model wrote its own state during export", 0,
        "Running the model (the reference, the input sets, the other sizes) changed its state: "
        "buffers and plain attributes (caches such as rotary-embedding frequency tables and "
        "their filled length, counters) are put back as they were before export; parameters the model writes in place in forward (first-call "
        "initialisation, e.g. gpytorch's variational strategy) are named and left as the model "
        "wrote them, as a plain call would.",
    ),
    "OM013": CodeInfo(
        "the model writes its inputs", 0,
        "forward() writes one of its inputs in place (`x.add_()`, `x[i] = v`, "
        "`x.index_add_()`, an `out=` op, a list or dict element replaced). Every run during "
        "export had its own copy of the example inputs, so the caller's tensors come back "
        "bit-equal and every reference is computed on pristine inputs. ONNX has no in-place "
        "inputs and torch.onnx does not return an input mutation as an output: the file "
        "computes the outputs, and hands back a written input's new value only where "
        "forward() returns it (the finding names that output); for the others it says so - "
        "return them from forward() if the caller needs them.",
    ),
    "OM014": CodeInfo(
        "not a generation package", 1,
        "The folder given to `onnxmedic optimize` holds no model.onnx: it is not a decoder "
        "generation package (the folder `onnxmedic export hf:CHECKPOINT --task "
        "text-generation-with-past -o FOLDER` or onnxruntime-genai's builder writes).",
    ),
    # OM1xx: preflight and capture
    "OM100": CodeInfo(
        "model fails in PyTorch", 1,
        "forward() raised when run eagerly on the example inputs: the model must work in "
        "PyTorch before it can be exported.",
    ),
    "OM101": CodeInfo(
        "input dtype does not match the model", 1,
        "forward() failed because an input's dtype does not match the parameters it meets "
        "(e.g. an int32 or float16 tensor fed to a float32 Linear).",
    ),
    "OM110": CodeInfo(
        "capture strategy failed", 1,
        "One torch.export strategy failed; onnxmedic tried the next one.",
    ),
    "OM111": CodeInfo(
        "model cannot be captured", 1,
        "Every capture strategy failed: torch.export cannot trace the model.",
    ),
    "OM112": CodeInfo(
        "data-dependent control flow", 1,
        "Python control flow depends on tensor values (if x.sum() > 0, .item()); rewrite it "
        "with torch.cond or torch.where.",
    ),
    "OM114": CodeInfo(
        "data-dependent branch specialised", 0,
        "Capture only worked with torch.export.draft_export, which follows the branch the "
        "example takes: the ONNX model computes that branch for every input. Verification adds "
        "inputs meant to take the other branches; a mismatch there shows the divergence.",
    ),
    "OM115": CodeInfo(
        "validation off for the capture", 0,
        "Capture failed on a data-dependent check that only raises or warns, and worked with "
        "validation off: the documented switches of the libraries in use (torch.distributions "
        "default validate_args=False; pyro.enable_validation(False); gpytorch.settings.debug"
        "(False); gpytorch and linear_operator settings.trace_mode(True), which also "
        "specialises psd_safe_cholesky's jitter retries to the first, plain Cholesky) and "
        "guards of an `assert` or of an `if` whose body only raises or warns decided as not "
        "raising. The settings are restored afterwards; verification runs against the model "
        "with validation on. The ONNX model does not reject inputs the checks would reject.",
    ),
    "OM116": CodeInfo(
        "branch decided by buffer values", 0,
        "Python control flow read a value the model keeps in a buffer; torch.export sees every "
        "buffer as an unknown input, while in the ONNX file buffers are constants "
        "(initializers), so onnxmedic captured with the buffers' current values known: 0-d "
        "integer buffers registered non-persistent (config constants: EnCodec's conv stride, "
        "kernel size and padding) as Python-known constants, and guards on values computed "
        "from buffers and constants alone (a flag such as gpytorch's updated_strategy, a time "
        "grid in `if t[0] > t[1]`, normflows' data_dep_init_done) decided by those values; a "
        "guard that involves an input still fails. The ONNX model computes the branch these "
        "values select, for every input; verification compares it with the eager model, and "
        "the model is left as it was. The finding names the buffers, values and lines.",
    ),
    "OM117": CodeInfo(
        "masked branch taken for every input", 0,
        "Python control flow tests whether a boolean mask selects anything (`if torch.any(m):`"
        ", nflows' splines: `if torch.any(inside_interval_mask):`) and the branch only writes "
        "through that mask (`out[m] = f(x[m])`, every tensor it reads also read through `m`): "
        "with nothing selected it writes nothing, so taking it for every input computes the "
        "same values. The capture took it; the ONNX model computes the branch on zero selected "
        "elements where the model skips it, and verification adds inputs meant to select none, "
        "all or some (zeros, negated, scaled, every third element scaled). Any other body (an "
        "else, a name assigned, a tensor read or written whole, a bare call, a call of a "
        "module) is not decided (OM112).",
    ),
    "OM118": CodeInfo(
        "size-keyed library cache switched off", 0,
        "Capture failed in a library's cache keyed on tensor sizes (tensorly's opt_einsum "
        "plugin, turned on by neuraloperator, plans each einsum from the operands' shapes and "
        "caches the plan under a key made of them; einx builds each call's graph from the "
        "sizes as Python ints and caches it under them): under dynamic shapes the sizes are "
        "symbolic, so the plan fixes the declared dims or the key cannot be hashed. onnxmedic "
        "captured again around the cache - with the library's own switch where it has one "
        "(tensorly.plugins.use_default_einsum(): the plain einsum, the same contraction), "
        "else by computing the same calls itself (einx's elementwise calls over plain axis "
        "names, such as `einx.where('b n, b n d, -> b n d', mask, x, 0.)`, as the torch op "
        "einx's graph calls, with torch broadcasting) - and put the settings and the cache's "
        "contents back afterwards; verification compared the ONNX model with the model as it "
        "is, cache on.",
    ),
    "OM119": CodeInfo(
        "branch decided by a value that depends on no input", 0,
        "Python control flow (an `if`, `.item()`, `int()`) read a tensor value that depends on "
        "no model input: a tensor the model makes in forward from constants and static sizes "
        "(a time grid built with torch.linspace or torch.arange, as torchcde's splines do, and "
        "torchdiffeq's fixed-step count read from it), a plain tensor attribute, or a value "
        "computed from parameters. torch.export "
        "cannot read such values (it traces with fake tensors), so onnxmedic captured with them "
        "known: an op whose arguments are all such values, constants and static sizes - no "
        "input, no dynamic size, no random numbers - was also run on the values, and guards on "
        "its results were decided by them. They are the same on every call, so the branch is "
        "the model's for every input; a guard that involves an input is not decided this way. "
        "The finding names the lines, the values read and the parameters they came from.",
    ),
    "OM125": CodeInfo(
        "model writes its own state on a call", 0,
        "forward() writes the model's own state when it runs - a buffer filled in place, a "
        "plain Python attribute assigned (rotary-embedding-torch fills cached_freqs and sets "
        "cached_freqs_seq_len on its first call), a counter. onnxmedic's example run would "
        "leave that state for capture to read as constants (right only at the example's "
        "sizes), so the buffers and attributes it wrote are put back first: capture traces the "
        "model in the state a plain call of the model as passed sees. The finding names what "
        "was written and the lines that write it.",
    ),
    "OM126": CodeInfo(
        "model initialised itself on the example run", 0,
        "forward() wrote parameters on the example run, beside its own state (first-call, "
        "data-dependent initialisation: normflows' ActNorm sets its scale and shift from the "
        "first batch and a flag): the model is captured and verified as initialised from the "
        "EXAMPLE INPUTS, and the ONNX file carries those values. Run the model on "
        "representative data (or load its trained state) before exporting.",
    ),
    "OM113": CodeInfo(
        "unsupported input or output type", 1,
        "forward() takes or returns a type torch.export cannot flatten.",
    ),
    "OM120": CodeInfo(
        "output types registered with pytree", 0,
        "forward() returns (or takes) objects torch.export cannot flatten - Hugging Face cache "
        "classes (DynamicCache, EncoderDecoderCache, ...) - and onnxmedic registered them with "
        "torch.utils._pytree (flatten/unflatten) so that capture succeeds; the finding names "
        "the classes.",
    ),
    "OM121": CodeInfo(
        "pytree registration failed", 0,
        "A type that needed pytree registration could not be registered; capture went on "
        "without it.",
    ),
    "OM122": CodeInfo(
        "decomposition crash worked around", 0,
        "torch's decompositions crashed on a view/reshape of a non-contiguous tensor under "
        "symbolic shapes (T5, Swin, XLNet attention); onnxmedic made those inputs contiguous "
        "(an Identity in ONNX) and the translation succeeded.",
    ),
    "OM123": CodeInfo(
        "rsub decomposition crash worked around", 0,
        "torch's decomposition of rsub(x, scalar) (`1.0 - mask`, XLNet) produced an aten.sub "
        "call no overload accepts; onnxmedic rewrote it as add(neg(x), scalar) and the "
        "translation succeeded.",
    ),
    "OM124": CodeInfo(
        "mixed scalar arguments worked around", 0,
        "torch.onnx's type promotion turned the int Scalar argument of a float op into a "
        "tensor but left its float one a number (`torch.clamp(x, 50, 4000.0)`, SincNet), and "
        "no overload of the op accepts that mix; onnxmedic wrote the ints as floats (the same "
        "values: the op computes in its float dtype) and the translation succeeded.",
    ),
    "OM127": CodeInfo(
        "sizes kept symbolic", 0,
        "Code turned a dynamic size into a Python number or a constant tensor, which fixes it "
        "to the example's value: `float(width - 1) / 2` or `int(n)` (torch.export refuses the "
        "dynamic dim, OM401), `torch.as_tensor(3 * length / 4)` (torch bakes the example's "
        "value into the program without a guard). The capture kept the size symbolic - "
        "`torch.sym_float`/the size itself for the `float()`/`int()` of the module whose line "
        "made the number, `torch.tensor` (built from the symbolic values) for `torch.as_tensor`"
        "/`torch.asarray` - computing the same values; verification runs the dynamic dims at "
        "other sizes. The finding names the lines.",
    ),
    # OM2xx: operators
    "OM201": CodeInfo(
        "operator has no ONNX translation", 1,
        "An ATen operator in the model has no translation in torchlib or onnxmedic.",
    ),
    "OM202": CodeInfo(
        "translation failed", 1,
        "A translation exists but failed for these arguments (dtype, rank, attribute).",
    ),
    "OM203": CodeInfo(
        "decomposition failed", 1,
        "Running torch's decompositions on the captured program failed.",
    ),
    "OM204": CodeInfo(
        "onnxmedic translation used", 0,
        "An operator was translated by onnxmedic's own registry (not torchlib).",
    ),
    "OM205": CodeInfo(
        "custom op inlined", 0,
        "A torch.library custom op without an ONNX translation was replaced by its Python "
        "implementation, traced into PyTorch ops that have translations.",
    ),
    "OM206": CodeInfo(
        "stride queries computed from sizes", 0,
        "The model reads tensor strides (`x.stride(d)`, aten.sym_stride.int), which ONNX does "
        "not have; where the tensor is provably contiguous, onnxmedic replaced each query by "
        "the product of the later dims' sizes (what the stride is). A stride of a tensor not "
        "provably contiguous is left and fails translation (OM201).",
    ),
    "OM215": CodeInfo(
        "as_strided input put in its storage order", 0,
        "aten.as_strided (`x.as_strided(size, stride)`) reads the tensor's storage, which ONNX "
        "does not have: its translation reads the values row-major. Where x is a view laid "
        "out densely in another order (a transposed tensor that reshape kept as a view, as in "
        "Longformer's and LED's chunking), onnxmedic permuted x to its storage order and made "
        "it contiguous first, which PyTorch computes the same.",
    ),
    "OM207": CodeInfo(
        "packed sequences captured padded", 0,
        "pack_padded_sequence -> nn.RNN/GRU/LSTM -> pad_packed_sequence cannot be traced (the "
        "packed data's sizes come from the lengths' values) and ONNX has no packed tensors; "
        "onnxmedic captured the path on the padded batch and its lengths (onnxmedic::"
        "padded_rnn), translated to ONNX's RNN/GRU/LSTM with sequence_lens: the same values "
        "(each sequence over its own length, states at its last valid step, padding past it, "
        "max(lengths) time steps), without pack_padded_sequence's checks of the lengths.",
    ),
    "OM208": CodeInfo(
        "packed sequence use not capturable", 1,
        "The model uses a PackedSequence other than as pack_padded_sequence -> nn.RNN/GRU/LSTM "
        "-> pad_packed_sequence (reads .data or .batch_sizes, or runs an LSTM with proj_size, "
        "which ONNX's LSTM lacks); no ONNX form keeps the packed layout.",
    ),
    "OM210": CodeInfo(
        "translation registry entry rejected", 1,
        "A translation registration was invalid or its module failed to import; the other "
        "translations are unaffected.",
    ),
    "OM211": CodeInfo(
        "quantized PyTorch op has no ONNX form", 1,
        "The model is quantized with torch.ao (eager quantize_dynamic, eager prepare + "
        "convert, FX prepare_fx + convert_fx): its modules run PyTorch's own quantized kernels "
        "(quantized::linear_dynamic, quantized::conv2d, ...) on QUInt8/QInt8 tensors and "
        "packed weights, which torch.export cannot trace and torch.onnx cannot translate. The "
        "finding names the op and the modules that run it, and the way around it: export the "
        "float model and quantize in ONNX Runtime with `--optimize --precision int8` (which "
        "verifies), dequantize the module, or quantize with PT2E (QDQ form).",
    ),
    "OM212": CodeInfo(
        "quantized input tensor", 1,
        "An example input is a quantized tensor (torch.quint8/qint8): ONNX Runtime has no "
        "quantized tensor type to feed. Pass the float tensor and quantize inside the model, "
        "or pass its int_repr() with the scale and zero point.",
    ),
    "OM213": CodeInfo(
        "set_ on an input worked around", 0,
        "forward() calls `x.set_(y)` on an input x (x then shares y's storage, shape and "
        "strides), which torch's decompositions cannot express for a graph input (\"Encountered "
        "a set_ on a graph input\"); onnxmedic made the program read y wherever it read x "
        "after the call (what x then is) and the translation succeeded. ONNX has no aliasing: "
        "the file returns x's new value only where forward() returns it (OM013).",
    ),
    "OM214": CodeInfo(
        "Python number output returned as a 0-d tensor", 0,
        "forward() returns a Python int, float or bool (`return x.shape[1] / 2` with static "
        "shapes, `dist.sample().size(0)`), which torch.export records as a constant. ONNX "
        "outputs are tensors, so the file returns it as a 0-d tensor of torch.tensor(value)'s "
        "dtype (float32, int64, bool), as torch.onnx's TorchScript exporter did; verification "
        "compares it so. The finding names the output and its value, fixed at export.",
    ),
    "OM220": CodeInfo(
        "torchvision op with no ONNX form", 1,
        "A torchvision operator ONNX has no operator for (ps_roi_align, ps_roi_pool: position-"
        "sensitive RoI pooling; box_iou_rotated) is in the model; the finding names the op and "
        "what to do (compute it outside the ONNX model, or with torchvision's per-bin roi_align).",
    ),
    "OM221": CodeInfo(
        "torchvision detection code captured in a traceable form", 0,
        "The model holds a torchvision module whose code torch.export cannot capture with "
        "data-dependent sizes (Mask R-CNN's per-box mask pasting, Keypoint R-CNN's heatmap "
        "decoding: Python loops over the boxes, resized to sizes read from their values): "
        "onnxmedic captured it with "
        "functions that compute the same thing with ops torch.export keeps symbolic, and put "
        "torchvision's back afterwards. Verification compares with torchvision's own code.",
    ),
    # OM3xx: dtypes for the target runtime
    "OM301": CodeInfo(
        "no kernel for this op and dtype on the target", 1,
        "ONNX Runtime has no kernel for these nodes as typed (e.g. bfloat16 Gemm on CPU), so "
        "it cannot load the model; found from ONNX Runtime's own kernel registrations.",
    ),
    "OM302": CodeInfo(
        "runs through casts ONNX Runtime inserts", 0,
        "float16 nodes without a CPU kernel: ONNX Runtime inserts float32 casts around them "
        "itself; they run, more slowly.",
    ),
    "OM303": CodeInfo(
        "mixed integer and float inputs", 1,
        "One node binds a type variable to two types (e.g. int64 and float in one Add); ONNX "
        "Runtime rejects it.",
    ),
    "OM304": CodeInfo(
        "no kernel on the target device: runs on the CPU", 0,
        "Nodes the target execution provider (e.g. CUDA) has no kernel for as typed; ONNX "
        "Runtime places them on the CPU, with copies between devices.",
    ),
    "OM305": CodeInfo(
        "not taken by TensorRT: runs on CUDA between engines", 0,
        "--target tensorrt: nodes ONNX-TensorRT's parser does not support as typed (its "
        "operator support matrix); ONNX Runtime runs them on CUDA, splitting the graph into "
        "several TensorRT engines (the count is given).",
    ),
    "OM310": CodeInfo(
        "dtypes repaired for the target", 0,
        "onnxmedic inserted casts (dtype policy upcast or boundary) so that every node has a "
        "kernel on the target; the repaired model was verified.",
    ),
    "OM311": CodeInfo(
        "dtype repair not possible", 1,
        "A node without a kernel could not be repaired with casts (the reason is given).",
    ),
    "OM320": CodeInfo(
        "opset converted", 0,
        "The model was converted from torch.onnx's native opset 18 to the requested opset, or "
        "by default to the highest the target supports (torch.onnx, the ONNX Runtime release "
        "and TensorRT each set a ceiling), with the ONNX version converter, and verified.",
    ),
    "OM321": CodeInfo(
        "opset conversion failed", 1,
        "The ONNX version converter could not convert the model to the requested opset.",
    ),
    "OM322": CodeInfo(
        "model too new for the target ONNX Runtime", 1,
        "The opset or IR version is higher than the ONNX Runtime release named by "
        "--ort-version can load (ONNX Runtime's compatibility matrix).",
    ),
    "OM323": CodeInfo(
        "fitted to the target ONNX Runtime", 0,
        "The opset and/or IR version were lowered to what the --ort-version release loads; "
        "the model was verified afterwards.",
    ),
    "OM324": CodeInfo(
        "default opset not reached; kept a lower one", 0,
        "The version converter could not convert the model to the highest opset the target "
        "supports; it was kept at the opset the converter reached, which the target loads "
        "too.",
    ),
    "OM325": CodeInfo(
        "default opset lowered for ONNX Runtime's kernels", 0,
        "Some op versions of the default opset have no ONNX Runtime kernel (RandomUniformLike-22) "
        "while their previous versions have; the model was translated again at the newest "
        "opset that runs them.",
    ),
    # OM4xx: dynamic shapes
    "OM401": CodeInfo(
        "dynamic shape constraint violated", 1,
        "A dimension declared dynamic is specialised or constrained by the model. The finding "
        "names the line that fixed it; where that is a library that computes with the sizes "
        "as Python ints by design (einx: each call's graph is built from integer sizes and "
        "cached under them, with no setting that keeps a size symbolic; onnxmedic computes "
        "only its elementwise calls over plain axis names itself, OM118), it also names the "
        "call into the library and the torch rewrite of it.",
    ),
    "OM402": CodeInfo(
        "dynamic dimension does not work at other sizes", 1,
        "A dimension the ONNX model declares dynamic fails in ONNX Runtime, or computes wrong "
        "numbers, at a size other than the example's: an op baked the example's size in.",
    ),
    "OM403": CodeInfo(
        "input variant skipped", 0,
        "PyTorch itself rejects the model on a generated input variant (a size of a dynamic "
        "dimension, or a branch probe after a specialised capture), so it was not checked "
        "there.",
    ),
    "OM404": CodeInfo(
        "dynamic dims chosen automatically", 0,
        "dynamic_shapes='auto' (--dynamic auto): which input dims stayed dynamic and which the "
        "model fixed.",
    ),
    "OM407": CodeInfo(
        "a dimension declared dynamic is static in the ONNX model", 1,
        "A dim the user declared dynamic came out of translation with a fixed size, so the "
        "written model would reject every other size: the export stops instead of writing it. "
        "The finding names the input, the dim and the size it was fixed to.",
    ),
    "OM406": CodeInfo(
        "dynamic shapes refined by torch.export's suggested fixes", 0,
        "The dynamic shapes as given violated the model's constraints; torch.export's "
        "suggested fixes (equal dims, constants, bounds) were applied and capture retried.",
    ),
    "OM408": CodeInfo(
        "dynamic dimension valid only at some sizes", 0,
        "torch.export followed code that holds only at some sizes of a dynamic dim (a multiple "
        "of k, a minimum: a UNet's skip concatenation, a branch on size % k) and recorded it as "
        "a guard the ONNX file drops. The file failed at sizes the guard excludes and verified "
        "at sizes it allows; it was written with the rule in its metadata_props "
        "('onnxmedic.dim_constraints'). The finding names the rule and the line that "
        "introduced it.",
    ),
    "OM409": CodeInfo(
        "sizes checked as the file declares", 0,
        "The ONNX file declares size rules for its dynamic dims (metadata_props "
        "'onnxmedic.dim_constraints', written with OM408); verification checked only sizes "
        "they allow.",
    ),
    # OM5xx: ONNX checks and ONNX Runtime
    "OM501": CodeInfo("ONNX checker failed", 1, "onnx.checker rejected the model."),
    "OM502": CodeInfo(
        "shape inference failed", 1,
        "ONNX shape inference found inconsistent types or shapes.",
    ),
    "OM510": CodeInfo(
        "ONNX Runtime cannot load the model", 1,
        "InferenceSession creation failed (missing kernel, bad graph, unsupported opset).",
    ),
    "OM511": CodeInfo(
        "ONNX Runtime run failed", 1, "The session loaded but run() raised an error."
    ),
    "OM512": CodeInfo(
        "ONNX Runtime hung", 1,
        "Loading or running did not finish within the timeout; the process was killed.",
    ),
    "OM513": CodeInfo(
        "ONNX Runtime crashed", 1,
        "The ONNX Runtime process died (abort, segmentation fault) while loading or running.",
    ),
    "OM514": CodeInfo(
        "ONNX Runtime ran out of memory", 1,
        "Loading or running exceeded the sandbox memory cap.",
    ),
    "OM515": CodeInfo(
        "captured on fake weights", 0,
        "The model's weights are large against the memory available, so it was captured and "
        "translated on fake weights (shapes only) and its own tensors were bound to the ONNX "
        "model afterwards (streamed into the file, not copied); the result is the same model.",
    ),
    "OM516": CodeInfo(
        "verified in a memory-lean ONNX Runtime session", 0,
        "The model is big (1 GiB or more, or 5% of the memory available), so the sandbox "
        "ran it in a session "
        "that holds its weights once (memory-mapped, no folded or packed copies) with ONNX "
        "Runtime's basic graph optimizations: a default session (extended fusions, packed "
        "MatMul weights) rounds some results differently, within the rounding of the model's "
        "dtype.",
    ),
    "OM520": CodeInfo(
        "external data outside the model folder", 1,
        "A tensor's external-data location is absolute, climbs out with '..', or resolves (via "
        "symlinks) outside the model's folder; the file is refused before any runtime reads it.",
    ),
    "OM521": CodeInfo(
        "external data missing", 1,
        "A tensor's external-data file is not next to the model.",
    ),
    "OM530": CodeInfo(
        "unused initializers", 0,
        "Initializers that no node uses: they only make the file bigger.",
    ),
    "OM531": CodeInfo(
        "dynamic dimensions", 0,
        "The model's inputs and outputs have these dynamic (named or unknown) dimensions.",
    ),
    "OM532": CodeInfo(
        "missing shape information", 0,
        "Some intermediate values have no type or shape after ONNX shape inference.",
    ),
    "OM533": CodeInfo(
        "opset newer than the runtime", 1,
        "The model's opset is higher than the ONNX Runtime in use supports.",
    ),
    "OM534": CodeInfo(
        "smoke test ran", 0,
        "The model loaded and ran in the sandbox on random inputs; the finding gives the time "
        "and output shapes.",
    ),
    "OM535": CodeInfo(
        "target execution provider not available", 0,
        "The target's execution provider (e.g. CUDAExecutionProvider) is not in this ONNX "
        "Runtime or found no device; ONNX Runtime fell back to the CPU, so the model was "
        "verified on the CPU only.",
    ),
    "OM536": CodeInfo(
        "verified on CUDA with TF32 off", 0,
        "The model ran on ONNX Runtime's CUDA provider with use_tf32=0, PyTorch's default "
        "float32 precision; with the provider's default TF32 math its float32 results differ "
        "from PyTorch's by about 1e-4 to 1e-3 relative.",
    ),
    "OM537": CodeInfo(
        "verified a CPU stand-in of a GPU model", 0,
        "The target's GPU provider is not available here and some nodes have no CPU kernel as "
        "typed (e.g. bfloat16 Gemm); a copy with those nodes in float32 was verified instead. "
        "The written model is unchanged and was not run as written.",
    ),
    "OM540": CodeInfo(
        "reduced model written", 0,
        "`onnxmedic reduce` shrank the model to a smaller one that still fails the same way; "
        "the finding names the file, its node count, the inputs (.npz) and the repro script.",
    ),
    "OM541": CodeInfo(
        "failure not reproduced", 1,
        "`onnxmedic reduce` ran the input model and it does not show the failure asked for "
        "(--until), so there is nothing to reduce.",
    ),
    "OM542": CodeInfo(
        "reduce budget exhausted", 0,
        "`onnxmedic reduce` stopped at its limit of candidate runs (or time); the model written "
        "still fails but may not be minimal.",
    ),
    "OM543": CodeInfo(
        "bad --until criterion", 2,
        "The --until value is not crash, hang, mismatch or a shell command containing {model}.",
    ),
    "OM544": CodeInfo(
        "int8 file verified for another instruction set", 0,
        "doctor/run: an int8 file onnxmedic verified with settings for one CPU instruction set "
        "(optimize --target cpu:avx512-vnni, cpu:amx, ...: full 8-bit weights) meets a CPU "
        "whose u8s8 int8 kernels add pairs of products in int16 (x86-64 without VNNI), where "
        "they can saturate: its outputs may fall outside the budget it was verified to.",
    ),
    "OM545": CodeInfo(
        "int8 file verified on another instruction set", 0,
        "doctor/run: an int8 file onnxmedic verified on another CPU instruction set than this "
        "one (the file's metadata onnxmedic.int8.verified_on); its settings do not saturate "
        "here, but it was not verified here.",
    ),
    "OM546": CodeInfo(
        "int8 kernels saturate on this CPU: verified with session.x64quantprecision", 0,
        "verify: a QDQ/QOperator file's outputs differ with ONNX Runtime's default int8 kernels "
        "and with its session setting session.x64quantprecision=1, so this CPU's u8s8 kernels "
        "saturate (x86-64 AVX2 without VNNI). The default is outside the budget, the setting "
        "verifies it: both figures are given, the file's metadata (onnxmedic.ort.session_config)"
        " records the setting, `onnxmedic run` uses it, and the user's own SessionOptions need "
        "it on such CPUs. The file is correct; the CPU's default kernels are not exact.",
    ),
    "OM547": CodeInfo(
        "int8 kernels saturate on this CPU, and the file fails with the exact ones too", 0,
        "verify: as OM546, the u8s8 kernels saturate on this CPU, but the file is outside the "
        "budget with session.x64quantprecision=1 as well: something besides the instruction "
        "set is wrong (the OM601 beside it says what).",
    ),
    "OM548": CodeInfo(
        "file verified with ONNX Runtime session settings", 0,
        "doctor/run: the file records the ONNX Runtime session config entries it was verified "
        "with (metadata onnxmedic.ort.session_config, e.g. session.x64quantprecision=1 after "
        "OM546); onnxmedic runs it with them, and the finding shows the line a user's own "
        "SessionOptions need.",
    ),
    # OM6xx: numbers
    "OM601": CodeInfo(
        "output values differ from PyTorch", 1,
        "ONNX Runtime computed values outside the acceptance rule: against a float64 run of "
        "the model, its error exceeds the budget PyTorch's own float32 error sets (normwise or "
        "at single elements); without a float64 run, outside the scaled normwise tolerance; "
        "integer and boolean outputs differ at all. A user-given rtol/atol is applied as is.",
    ),
    "OM602": CodeInfo(
        "output structure differs from PyTorch", 1,
        "Output count, shape or dtype differs between ONNX Runtime and PyTorch.",
    ),
    "OM603": CodeInfo(
        "output not verified at all input sets", 0,
        "Some further input sets could not be generated; verification used fewer.",
    ),
    "OM604": CodeInfo(
        "model numerically unstable on the input", 0,
        "PyTorch's own float32 result is far from its float64 result on this input (over 1% "
        "normwise for float32): the model amplifies rounding. ONNX Runtime is still judged "
        "against the float64 run with the usual budget, so its own rounding is not a false "
        "mismatch; the outputs themselves are only as good as float32 allows.",
    ),
    "OM605": CodeInfo(
        "no float64 reference", 0,
        "The model was not run in float64 (too big to copy into the memory available, no "
        "float64 kernel, not copyable), or computes some outputs in float32 itself: those "
        "outputs are judged by the scaled normwise rule against PyTorch's float32 output.",
    ),
    "OM610": CodeInfo(
        "first divergent node", 1,
        "Localisation: the first PyTorch (FX) node, in topological order, whose value in ONNX "
        "Runtime is outside tolerance, with its ATen op, the ONNX node, module path and file:line, "
        "and its inputs' errors (to tell an error born there from an inherited one).",
    ),
    "OM611": CodeInfo(
        "localisation incomplete", 0,
        "Localisation could not match ONNX values to PyTorch nodes, or could not run one side "
        "node by node; the verification result itself stands.",
    ),
    "OM612": CodeInfo(
        "no divergent intermediate value", 0,
        "Localisation compared the intermediate values it could match and none is outside "
        "tolerance.",
    ),
    "OM613": CodeInfo(
        "detection dropped", 1,
        "Detection comparison: a detection (box, score, class) PyTorch makes has no counterpart "
        "in ONNX Runtime's set: no box of its class within the budget, and no leftover box that "
        "explains it (OM615-OM617).",
    ),
    "OM614": CodeInfo(
        "extra detection", 1,
        "Detection comparison: ONNX Runtime makes a detection PyTorch does not, and it explains "
        "no dropped one.",
    ),
    "OM615": CodeInfo(
        "detection with the wrong class", 1,
        "Detection comparison: a detection is found at its box (IoU at least the match threshold)"
        " but with another class.",
    ),
    "OM616": CodeInfo(
        "detection box elsewhere", 1,
        "Detection comparison: a detection of the right class overlaps its counterpart but its "
        "corners are outside the budget (a wrong box).",
    ),
    "OM617": CodeInfo(
        "detection score outside the budget", 1,
        "Detection comparison: a detection is found with its class and box but its score differs "
        "by more than the budget.",
    ),
    "OM618": CodeInfo(
        "outputs are not a detection set", 1,
        "Detection comparison: boxes are not [N, 4], or boxes, scores and labels disagree on N.",
    ),
    "OM619": CodeInfo(
        "per-detection output differs", 1,
        "Detection comparison: an output with a row per detection (Mask R-CNN's masks, Keypoint "
        "R-CNN's keypoints or their scores) differs for a pair of matched detections by more "
        "than the budget (a wrong mask, a shifted keypoint).",
    ),
    "OM621": CodeInfo(
        "near tie upstream of a detection set", 0,
        "Detection comparison: ONNX Runtime's detections differ from PyTorch's because a TopK "
        "upstream (an RPN's pre-NMS top-n) picks another item at a near tie: the items it "
        "exchanges lie, in the float64 run, within ONNX Runtime's float32 error of the cut, and "
        "that error is within the budget of PyTorch's own. Run once more with that TopK picking "
        "as the float64 run does, ONNX Runtime's detections agree; the finding names the node.",
    ),
    "OM620": CodeInfo(
        "eager quantized model exported through its float twin", 0,
        "export: an eager torch.ao quantized model (quantize_dynamic's Linear, LSTM, GRU; "
        "static Quantize / Conv2d / ConvReLU2d / Linear / LinearReLU / DeQuantize), or an FX "
        "one (prepare_fx + convert_fx) of those modules, is exported as the "
        "arithmetic its quantized kernels compute, in ONNX ops (float ops and QDQ), and "
        "verified against PyTorch's own quantized run. A quantized module without such a form "
        "keeps OM211.",
    ),
    # OM7xx: sweeps over a model zoo
    "OM700": CodeInfo(
        "zoo entry not verified", 1,
        "One entry of the sweep did not export and verify; the entry's own findings say why.",
    ),
    "OM701": CodeInfo(
        "zoo entry crashed", 1,
        "The worker process of an entry died (abort, segmentation fault, killed) before "
        "writing its result; the other entries went on.",
    ),
    "OM702": CodeInfo(
        "zoo entry timed out", 1,
        "An entry did not finish within the sweep's timeout; its worker process group was "
        "killed and the other entries went on.",
    ),
    "OM703": CodeInfo(
        "zoo factory failed", 1,
        "The entry's factory raised while building the model or its inputs.",
    ),
    "OM704": CodeInfo(
        "zoo unusable", 1,
        "The zoo spec names no file, module or folder defining ZOO = {name: factory}, an "
        "entry is not callable, a name is defined twice, or --only names an unknown entry.",
    ),
    "OM705": CodeInfo(
        "Ray not installed", 2,
        "--executor ray was asked for but the ray package is not installed (pip install "
        "'onnxmedic[ray]').",
    ),
    "OM706": CodeInfo(
        "results file unusable", 1,
        "The file given to --resume is not a sweep results file or cannot be read.",
    ),
    "OM707": CodeInfo(
        "sweep resumed", 0,
        "Entries already in the results file were skipped.",
    ),
    "OM708": CodeInfo(
        "sweep summary", 0,
        "How many entries were verified, failed, crashed or timed out.",
    ),
    "OM709": CodeInfo(
        "Ray cluster unavailable", 1,
        "The Ray cluster could not be started or joined.",
    ),
    "OM710": CodeInfo(
        "zoo entry check failed", 1,
        "The entry's own check (e.g. greedy decoding with past_key_values in ONNX Runtime "
        "against PyTorch) failed after a verified export.",
    ),
    # OM72x: optimization (onnxmedic.optimize)
    "OM720": CodeInfo(
        "optimized variant written", 0,
        "A candidate variant verified against PyTorch on every input set and beat the plain "
        "export beyond the noise rule; it was written instead of the plain export.",
    ),
    "OM721": CodeInfo(
        "plain export kept", 0,
        "No candidate variant both verified and beat the plain export beyond the noise rule; "
        "the plain export was written. Each variant's reason is listed.",
    ),
    "OM722": CodeInfo(
        "CPU fallback", 0,
        "onnxmedic bench: nodes ran on the CPU execution provider on a GPU target (the provider "
        "is missing or has no kernel for them); the nodes are named.",
    ),
    "OM723": CodeInfo(
        "device copies", 0,
        "onnxmedic bench: ONNX Runtime inserted Memcpy nodes between host and device; each "
        "one is named.",
    ),
    "OM724": CodeInfo(
        "float16 block list", 0,
        "--precision fp16: nodes kept in float32 because a value they compute or read, "
        "measured in float32 on the verification inputs, exceeds float16's range "
        "(|x| > 65504; where only fill values do, they are first left to saturate: OM727) "
        "or underflows it (1% or more of its magnitude below 6.1e-05, float16's "
        "smallest normal); where the candidate still failed its budget, also the nodes that "
        "add most error in float16 (measured against float32 on the verification inputs, "
        "on the target's provider) with the nodes they read from. Each node is named with "
        "the value and the measurement.",
    ),
    "OM725": CodeInfo(
        "optimize target not available", 0,
        "--target cuda/tensorrt: the target's execution provider is not in this ONNX Runtime "
        "or found no device (a CPU build, no GPU). The candidates were built and verified on "
        "the CPU, but none could be timed on the target, so the plain export was kept. Run "
        "optimize where onnxruntime-gpu sees the GPU.",
    ),
    "OM726": CodeInfo(
        "CUDA graph not possible", 0,
        "onnxmedic bench: the file was to be timed as a CUDA graph (--cuda-graph, or the run "
        "settings optimize recorded in it) but could not run as one here: no CUDA provider, or "
        "ONNX Runtime refused the capture (a node outside the CUDA provider, device copies); "
        "its reason is quoted. The file itself runs, without a graph.",
    ),
    "OM728": CodeInfo(
        "int8 not verified on the named instruction set", 0,
        "optimize --target cpu:<isa>: the int8 candidates were verified on this CPU, whose "
        "instruction set is not the one named, so what that instruction set's int8 kernels "
        "compute was not checked.",
    ),
    "OM729": CodeInfo(
        "int8 settings and instruction set", 0,
        "optimize --precision int8: the int8 settings (portable: 7-bit weights that ONNX "
        "Runtime's u8s8 kernels do not saturate on any x86-64 CPU; or full 8-bit weights for "
        "a named instruction set) and the CPU instruction set the candidates were verified on, "
        "which an int8 file written records in its metadata.",
    ),
    "OM727": CodeInfo(
        "float16 fill values saturated", 0,
        "--precision fp16: values whose only elements beyond float16's range are fill values "
        "(|x| >= 1e8: an attention mask's torch.finfo(torch.float32).min, a masked_fill's "
        "-1e9) were left in float16, where they saturate to +-65504 or +-inf, instead of "
        "keeping every node that reads them (a fused attention, a softmax) in float32; the "
        "variant was verified like any other. Where it was not, the finding says why and the "
        "nodes were kept in float32 (OM724).",
    ),
    "OM730": CodeInfo(
        "int4 candidate outside the task budget", 0,
        "--precision int4: an int4 candidate of the decoder step was measured outside the "
        "task budget (perplexity on the built-in text against PyTorch float32's, greedy "
        "agreement with PyTorch float32's tokens over N steps from several prompts); the "
        "finding gives both figures and the first step where it diverges per prompt. It was "
        "not written.",
    ),
    "OM731": CodeInfo(
        "no int4 candidate within the task budget", 1,
        "--precision int4: no int4 candidate of the decoder step was within the task budget, "
        "so no int4 file was written; every candidate's perplexity and greedy agreement are "
        "listed. Keep the float32 file, or give a looser budget with --accuracy if those "
        "figures suit the task.",
    ),
    "OM732": CodeInfo(
        "int4 decoder written", 0,
        "--precision int4: the fastest int4 candidate within the task budget was written; "
        "its perplexity, greedy agreement and decode-step latency are given with every "
        "other candidate's.",
    ),
    "OM733": CodeInfo(
        "not a decoder step", 1,
        "--precision int4 takes a decoder step: input_ids and the flat past (batch, heads, "
        "past, head_dim) in, the logits and the present out, with a PyTorch model of the same "
        "contract (bench/zoo/hf.py's DecodeStep); the file given is not one.",
    ),
    "OM734": CodeInfo(
        "fused decoder package written", 0,
        "A generation package's decoder was rewritten with ONNX Runtime's transformer fusions "
        "(onnxscript's ort_fusions: SkipSimplifiedLayerNormalization, "
        "SimplifiedLayerNormalization, MultiHeadAttention or GroupQueryAttention, "
        "FusedMatMul) and verified like any other candidate: greedy generation token by token "
        "against PyTorch within the float32 budget, and in onnxruntime-genai. The finding "
        "lists the fused ops.",
    ),
    "OM735": CodeInfo(
        "fused decoder outside the budget", 1,
        "A generation package's fused decoder generated tokens or logits outside the float32 "
        "budget against PyTorch (or onnxruntime-genai disagreed); it was not written. The "
        "finding gives the step and figures; keep the plain package. From `export hf:... "
        "--optimize` it is a warning: the plain package, verified, is written instead.",
    ),
    "OM736": CodeInfo(
        "int4 package not served by onnxruntime-genai", 1,
        "--precision int4 on a generation package: the int4 decoder chosen within the task "
        "budget was generated from with onnxruntime-genai, which did not give ONNX Runtime's "
        "own greedy tokens for it (or could not load the folder); the int4 package was not "
        "written.",
    ),
    "OM737": CodeInfo(
        "package's PyTorch model cannot be loaded", 1,
        "onnxmedic optimize PACKAGE_FOLDER MODEL: the generation package is verified against "
        "the checkpoint it was exported from, and MODEL (a folder written by save_pretrained, "
        "hf: optional) could not be loaded as a causal LM. Nothing was written.",
    ),
    "OM738": CodeInfo(
        "package output is not a package folder", 1,
        "A generation package (export hf:... -o FOLDER, optimize PACKAGE ... -o FOLDER) replaces "
        "the whole folder it is written to; -o named an existing file, or a non-empty folder "
        "that is not a package (no ONNX graph, no genai_config.json, or a subfolder), whose "
        "files would be lost. Nothing was built or written.",
    ),
    "OM739": CodeInfo(
        "ONNX Runtime's own operators in the ONNX domain", 0,
        "Nodes of the ONNX domain that are no ONNX operator but one ONNX Runtime defines there "
        "(onnxruntime-genai's builder writes SimplifiedLayerNormalization so): onnx.checker "
        "cannot judge them, so the rest of the graph is checked around them instead of the "
        "file being rejected (OM501); ONNX Runtime runs it, other runtimes will refuse it.",
    ),
    "OM740": CodeInfo(
        "an encoder-decoder package has no optimized variant", 1,
        "`onnxmedic optimize PACKAGE hf:CHECKPOINT` was given an encoder-decoder generation "
        "package (encoder_model.onnx and decoder_with_past_model.onnx, as export hf: writes "
        "T5, BART, Whisper): optimize fuses and quantizes decoder-only packages (model.onnx); "
        "an encoder-decoder package is served as export wrote it, verified at float32. "
        "Nothing is written.",
    ),
    "OM741": CodeInfo(
        "package cannot be transformed here", 1,
        "optimize PACKAGE --precision fp32|int4, or export hf:... --precision int4: the "
        "package cannot be made at that precision here, said before any work: it has no "
        "genai_config.json (onnxruntime-genai cannot serve it, and every transformed package "
        "is judged by onnxruntime-genai generating from it): our export's packages whose cache "
        "onnxruntime-genai cannot name or feed (MLA's different key and value sizes, OM820; "
        "LFM2's, Mamba's and Falcon-H1's states, taken one token per step, OM829; the "
        "builder's LFM2 package has one). Nothing is written; the float32 package stands.",
    ),
    "OM742": CodeInfo(
        "int4 calibration text unusable", 1,
        "--precision int4 --calibration TEXT: the text cannot calibrate GPTQ or be measured "
        "on: the file cannot be read as UTF-8, the model has no tokenizer to encode it, or it "
        "is shorter than two windows of 128 tokens (one to calibrate, one held out for the "
        "perplexity on the user's text). Nothing was built.",
    ),
    "OM743": CodeInfo(
        "written int4 file diverges when generating on its own", 0,
        "--precision int4: the written candidate is within the budget, which reads greedy "
        "agreement teacher-forced (each step fed PyTorch's tokens), but generating on its own "
        "it keeps fewer of PyTorch float32's greedy tokens than the budget's share. The "
        "finding gives the first divergence per prompt and PyTorch's own gap between its two "
        "best logits there: a gap far below the median is a near tie of the float32 model. "
        "Require free-running agreement too with --accuracy free=95%.",
    ),
    # OM80x: Hugging Face checkpoints (onnxmedic.hf, export hf:...)
    "OM800": CodeInfo(
        "not a Hugging Face checkpoint", 1,
        "The folder given is missing, a file, or not a checkpoint: no config.json, a config "
        "that cannot be read, or a config without weights (model.safetensors, "
        "pytorch_model.bin). Nothing was loaded or written.",
    ),
    "OM801": CodeInfo(
        "hub checkpoint cannot be fetched", 1,
        "A hub id was given but its files cannot be downloaded or found in the local cache: "
        "no network, HF_HUB_OFFLINE set without a cached snapshot, or no such repository.",
    ),
    "OM802": CodeInfo(
        "checkpoint needs its own code", 1,
        "The checkpoint's architecture is defined only by Python code it ships (config.json "
        "auto_map); onnxmedic never runs it unless trust_remote_code=True "
        "(--trust-remote-code) is given, and ran nothing from it.",
    ),
    "OM803": CodeInfo(
        "unsafe pickled weights refused", 1,
        "A pytorch_model.bin holds Python objects that are not plain tensors: unpickling it "
        "could run code. .bin weights are read only with torch.load(weights_only=True); the "
        "file was refused and nothing of it was run.",
    ),
    "OM804": CodeInfo(
        "unknown task", 2,
        "The task named is not one of optimum's task names that onnxmedic knows; the message "
        "lists them.",
    ),
    "OM805": CodeInfo(
        "task not served by the model", 1,
        "The model cannot serve the task asked for (its type has no head for it), or the task "
        "cannot be told from config.architectures; the message names the tasks it can serve.",
    ),
    "OM806": CodeInfo(
        "tokenizer missing", 1,
        "The task takes text but the checkpoint folder has no tokenizer (or it cannot be "
        "loaded): the example inputs and the deployment both need it.",
    ),
    "OM807": CodeInfo(
        "task not available", 1,
        "A generation task (with a KV cache, or an encoder-decoder) whose export is not "
        "available in this onnxmedic; the message names what is.",
    ),
    "OM808": CodeInfo(
        "checkpoint cannot be loaded", 1,
        "transformers cannot build the model from the checkpoint (corrupt or mismatched "
        "weights, a model type the installed transformers does not know), or transformers / "
        "huggingface_hub is not installed.",
    ),
    "OM809": CodeInfo(
        "checkpoint exported for a task", 0,
        "What export_pretrained did: the task (given or detected from config.architectures), "
        "the dtype the checkpoint was loaded in, where the example inputs came from (the "
        "folder's tokenizer, the config), and the input and output names.",
    ),
    # OM810-OM829: generation packages of Hugging Face decoders (hf/generation.py)
    "OM810": CodeInfo(
        "decoder graph not exported", 1,
        "text-generation-with-past: the decoder's one-step graph (input ids, attention mask, "
        "position ids and the KV cache in; logits and the new cache out) did not export and "
        "verify with onnxmedic.export; the export's own findings say why. Nothing is written.",
    ),
    "OM811": CodeInfo(
        "generated tokens differ", 1,
        "Greedy generation in ONNX Runtime (onnxmedic's loop, fed its own cache) chose another "
        "token than PyTorch's generate(do_sample=False), and the logits of that step are "
        "outside the float64 budget; the prompt, step and position are named, and the first "
        "ONNX node outside its budget at that step is localised (OM610).",
    ),
    "OM812": CodeInfo(
        "generation logits outside budget", 1,
        "A generation step's logits are outside the float64-anchored budget although the greedy "
        "tokens so far match (a wrong cache shows from the first decode step).",
    ),
    "OM813": CodeInfo(
        "greedy tie", 0,
        "Greedy generation picked another token than PyTorch at a step whose logits are within "
        "the float64 budget: the two best logits are closer than float32 rounding can tell "
        "apart. The steps after it are not compared.",
    ),
    "OM814": CodeInfo(
        "onnxruntime-genai tokens differ", 1,
        "onnxruntime-genai, generating greedily from the package folder, gave other tokens than "
        "PyTorch's generate(do_sample=False).",
    ),
    "OM815": CodeInfo(
        "onnxruntime-genai not installed", 0,
        "The package was verified with onnxmedic's own generation loop only: onnxruntime-genai "
        "is not installed (pip install onnxruntime-genai).",
    ),
    "OM816": CodeInfo(
        "onnxruntime-genai cannot use the package", 1,
        "onnxruntime-genai could not load or generate from the package folder (its error is "
        "quoted): a genai_config.json that does not match the graph, or a layout it does not "
        "support.",
    ),
    "OM817": CodeInfo(
        "model cannot serve the task", 1,
        "text-generation-with-past needs a decoder-only model with a language-model head "
        "(AutoModelForCausalLM) that keeps a cache; an encoder, an encoder-decoder or a model "
        "without generate() cannot serve it. An encoder's causal-LM class that keeps no cache "
        "(is_decoder=False) exports with --task text-generation.",
    ),
    "OM818": CodeInfo(
        "generation package not written", 1,
        "The package folder was not written (an existing one is left as it was) because the "
        "graph or its generation is not verified; keep_unverified=True keeps it anyway.",
    ),
    "OM819": CodeInfo(
        "generation package written", 0,
        "The package folder was written, with the files it holds.",
    ),
    "OM820": CodeInfo(
        "cache layout GenAI cannot describe", 0,
        "The decoder's cache has different head counts or head sizes for keys and values, or "
        "between layers (DeepSeek's compressed attention cache): genai_config.json has one of "
        "each, so none is written. The package serves ONNX Runtime, verified by onnxmedic's "
        "generation loop, but not onnxruntime-genai.",
    ),
    # OM821-OM834: encoder-decoder packages (hf/seq2seq.py, hf/seq2seq_verify.py)
    "OM821": CodeInfo(
        "encoder-decoder graph not exported", 1,
        "text2text-generation-with-past / automatic-speech-recognition-with-past: the encoder "
        "graph (the encoder and the cross-attention cache of its output) or the decoder graph "
        "(one decoder step with its caches) did not export and verify with onnxmedic.export; "
        "the message names which, the export's own findings say why. Nothing is written.",
    ),
    "OM822": CodeInfo(
        "model cannot serve the encoder-decoder task", 1,
        "text2text-generation-with-past needs an encoder-decoder with a language-model head "
        "that takes text (AutoModelForSeq2SeqLM), automatic-speech-recognition-with-past one "
        "that takes audio features (AutoModelForSpeechSeq2Seq); a decoder-only model, an "
        "encoder, or the other modality's model cannot serve it.",
    ),
    "OM823": CodeInfo(
        "encoder outputs outside budget", 1,
        "In generation, the encoder graph's output (its hidden states or a layer's "
        "cross-attention cache) is outside the float64-anchored budget: every decoder step "
        "reads it, so the decoder steps are not judged; the first ONNX node of the encoder "
        "graph outside its budget is localised (OM610).",
    ),
    "OM824": CodeInfo(
        "no decoder start token", 1,
        "The encoder-decoder names no decoder_start_token_id (generation_config.json or "
        "config.json): its decoder has no first token to generate from.",
    ),
    "OM825": CodeInfo(
        "no onnxruntime-genai model type", 0,
        "onnxruntime-genai has no model type for this encoder-decoder (it serves Whisper alone "
        "among them): the package has no genai_config.json and serves ONNX Runtime, verified "
        "by onnxmedic's generation loop.",
    ),
    "OM826": CodeInfo(
        "audio features the encoder cannot take", 1,
        "The feature extractor's input_features do not have the mel bins and frames the audio "
        "encoder takes (Whisper: num_mel_bins and 2 x max_source_positions), or no feature "
        "extractor fits the config: the folder's preprocessor_config.json belongs to another "
        "model, or is missing.",
    ),
    # OM827-OM834: the families of 2025-26 in generation packages (hf/generation.py)
    "OM827": CodeInfo(
        "cache layers the package cannot carry", 1,
        "text-generation-with-past: the model's own cache holds layers that the package's "
        "cache cannot carry: several states in one layer, a sliding-window attention cache "
        "beside a state, a sparse attention's indexer positions (Qwen4-Exp's), other state "
        "beside the keys and values that a step updates (DeepSeek-V4's compressor buffers and "
        "compressed entries), or a layer with neither keys nor a state. (Keys and values, a "
        "sparse attention's indexer keys (AXK2, HY-V4), and one convolution and one "
        "state-space state per layer are carried: LFM2, Mamba, Mamba-2, Falcon-H1, MiniMax.) "
        "Nothing is exported; --task text-generation (no cache) exports the model.",
    ),
    "OM828": CodeInfo(
        "PyTorch fails on onnxmedic's step inputs", 1,
        "text-generation-with-past: PyTorch raises on the decoder step's example inputs that "
        "onnxmedic built from the model's own cache (3 new tokens after a past of 4, the "
        "cache fed back as a plain DynamicCache of its keys and values), a step generate() "
        "does not take (MiniCPM3 with fewer KV heads than query heads): a limit of "
        "onnxmedic's package for this model, not a fault of the model. The finding gives "
        "PyTorch's error; --task text-generation exports the model without its cache. "
        "text2text-generation-with-past: the same for the decoder step of an encoder-decoder "
        "(ProphetNet's decoder takes one token per step with its cache).",
    ),
    "OM829": CodeInfo(
        "state cache: no genai_config.json", 0,
        "text-generation-with-past: the model's cache holds convolution or state-space "
        "states (past.{i}.conv / past.{i}.recurrent in, present.{i}.* out) and the package's "
        "graph takes one token per step (the prompt too, from zero states), as these models' "
        "own code takes a previous state; onnxruntime-genai feeds the whole prompt at once, "
        "so no genai_config.json is written. onnxmedic's own ONNX Runtime loop verifies the "
        "package token by token.",
    ),
    "OM830": CodeInfo(
        "the model's own forward with its cache raises", 1,
        "text-generation-with-past: the model raised in PyTorch itself when called as "
        "generate() first calls it (a short prompt, use_cache=True, its own cache created by "
        "the model), e.g. a tiny Jamba or Bamba config whose layer pattern leaves no attention "
        "layer (transformers' cache then cannot say its length). generate() raises the same; "
        "nothing is exported. The finding gives PyTorch's error.",
    ),
    "OM831": CodeInfo(
        "tokenizer gives ids the model has no embedding for", 1,
        "The checkpoint's tokenizer turns the verification's prompts into token ids at or "
        "beyond the model's vocab_size (its embedding's rows): the tokenizer and the weights "
        "do not belong together (a tokenizer with a larger vocabulary, or a config whose "
        "vocab_size was not updated after tokens were added). PyTorch itself cannot run such "
        "ids; nothing is written. The finding names the ids and the vocabulary sizes.",
    ),
    # OM835-OM849: generation packages made fast in one command (hf/generation.py)
    "OM835": CodeInfo(
        "package not optimized", 0,
        "export hf:... --optimize: the package asked for has no optimized variant here (an "
        "encoder-decoder package; a --precision other than fp32 for a decoder package, whose "
        "int4 variant is `onnxmedic optimize PACKAGE hf:CHECKPOINT -o OUT --precision int4`; "
        "or --no-verify, as a fused decoder is written only when verified). The package is "
        "exported as without --optimize.",
    ),
    # OM836-OM838: onnxruntime-genai's model builder as a backend (hf/backends.py)
    "OM836": CodeInfo(
        "package built by the genai builder", 0,
        "export hf:... --task text-generation-with-past: onnxruntime-genai's model builder "
        "built the package (its decoder fused: GroupQueryAttention, "
        "SkipSimplifiedLayerNormalization) and onnxmedic verified it as its own: greedy "
        "generation token for token against PyTorch, each step's logits within the float64 "
        "budget, and in onnxruntime-genai. The default (--backend auto) for the architectures "
        "the installed builder has a model class for.",
    ),
    "OM837": CodeInfo(
        "genai builder's package not used", 0,
        "onnxruntime-genai's model builder failed on the checkpoint, or its package did not "
        "verify (the finding says which step and token); onnxmedic's own export wrote the "
        "package instead. Nothing to do; report it to onnxruntime-genai if the builder should "
        "serve the model.",
    ),
    "OM838": CodeInfo(
        "genai builder cannot build the package", 1,
        "--backend builder: onnxruntime-genai's model builder cannot build the package "
        "(not installed, a model object rather than a checkpoint folder, a dtype other than "
        "fp32, an opset asked for, remote code), or it failed, or its package did not verify; "
        "nothing was written. Leave --backend out (auto) for onnxmedic's own export.",
    ),
    "OM839": CodeInfo(
        "package's decoder cannot be fed", 1,
        "A package transform (optimize PACKAGE hf:CHECKPOINT) read the package's decoder "
        "graph and cannot feed it a step (onnxmedic/genpackage.py's contract): no decoder "
        "graph, cache inputs that are not (batch, heads, past, head size), cache inputs "
        "without their present outputs, or a symbolic head size that neither "
        "genai_config.json nor config.json in the folder states; nothing was written.",
    ),
    "OM840": CodeInfo(
        "int4 asked for a task it does not serve", 1,
        "export hf:X --precision int4 makes a text-generation-with-past package (the decoder "
        "judged by the task budget); the checkpoint's task is another one, so nothing was "
        "exported. Drop --precision int4, or give --task text-generation-with-past for a "
        "decoder.",
    ),
    # OM850-OM859: a decoder's package stamped from one exported layer (hf/stamp.py)
    "OM850": CodeInfo(
        "a stamped part did not export and verify", 1,
        "The stamped road (a family onnxruntime-genai's builder does not serve, at size) "
        "exports the prelude (embedding, mask, rotary embedding), one decoder layer and the "
        "head once, each verified against PyTorch, then stamps the layer once per layer; one "
        "of those graphs did not export or verify, and the export's findings say why. Nothing "
        "was written.",
    ),
    "OM851": CodeInfo(
        "decoder graph stamped", 0,
        "The package's decoder graph was assembled from one exported and verified decoder "
        "layer, copied once per layer with each layer's weights streamed from the "
        "checkpoint's safetensors (hf/stamp.py); the whole package is then verified against "
        "the checkpoint streamed.",
    ),
    # OM860-OM869: the newest decoder families (issue 51)
    "OM860": CodeInfo(
        "TopK over tied values", 1,
        "Localisation: the first divergence is the indices of a TopK whose PyTorch input holds "
        "equal values among its k+1 best (e.g. an MoE router with all-zero weights, as "
        "transformers initialises some routers): which indices win is arbitrary, and PyTorch "
        "and ONNX Runtime break the tie differently. The model's numerics, not the "
        "translation; verify with trained weights.",
    ),
    # OM870-OM879: int4 packages made and judged streamed (hf/transforms/stream_int4.py)
    "OM870": CodeInfo(
        "int4 weights not a rounding of the float32 ones", 3,
        "A 4-bit weight of the int4 package the streamed road wrote lies more than one step "
        "(its block's scale) from the float32 weight it was made from: a corrupted block or a "
        "wrong scale, onnxmedic's own fault or the disk's, not the model's; nothing was "
        "written.",
    ),
    "OM871": CodeInfo(
        "streamed int4 package outside the task budget", 1,
        "The int4 package's greedy agreement with the checkpoint (streamed, teacher-forced "
        "along the int4 decoder's tokens) or its perplexity against PyTorch float32's is "
        "outside the task budget (docs/int4.md); nothing was written. The figures are in the "
        "finding.",
    ),
}


@dataclass
class Location:
    """Where in the user's code something happened."""

    file: str | None = None
    line: int | None = None
    function: str | None = None
    module_path: str | None = None  # e.g. "encoder.layer.3.attention"
    code: str | None = None  # the source line

    def __str__(self) -> str:
        parts = []
        if self.module_path:
            parts.append(f"module {self.module_path}")
        if self.file:
            parts.append(f"{self.file}:{self.line}" if self.line else self.file)
        return ", ".join(parts) or "unknown location"


@dataclass
class Finding:
    """One thing onnxmedic found. ``code`` is stable; see docs/findings.md."""

    code: str
    stage: str
    severity: Severity
    message: str
    op: str | None = None
    location: Location | None = None
    suggestion: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}; add it to findings.CODES")
        self.severity = Severity(self.severity)

    @property
    def title(self) -> str:
        return CODES[self.code].title

    @property
    def exit_code(self) -> int:
        return CODES[self.code].exit_code

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.value
        d["title"] = self.title
        return d

    def one_paragraph(self) -> str:
        """The message a user sees: what, where, and the next step."""
        text = f"{self.code} {self.title}: {self.message}"
        if self.op:
            text += f" [op: {self.op}]"
        if self.location is not None and (self.location.file or self.location.module_path):
            text += f" (at {self.location})"
        if self.suggestion:
            text += f"\n  Next step: {self.suggestion}"
        return text


def error(code: str, stage: str, message: str, **kw: Any) -> Finding:
    return Finding(code, stage, Severity.ERROR, message, **kw)


def warning(code: str, stage: str, message: str, **kw: Any) -> Finding:
    return Finding(code, stage, Severity.WARNING, message, **kw)


def info(code: str, stage: str, message: str, **kw: Any) -> Finding:
    return Finding(code, stage, Severity.INFO, message, **kw)


def refuse(finding: Finding) -> int:
    """A command that stops on ``finding`` (a user's mistake, not a result): its one paragraph
    on stderr; returns its exit code."""
    import sys

    sys.stderr.write(finding.one_paragraph() + "\n")
    return finding.exit_code


def print_findings(findings: Any) -> None:
    """Each of ``findings`` as the commands print their results: its code and message, a line
    each, on stdout."""
    for f in findings:
        print(f"{f.code} {f.message}")


class OnnxMedicError(Exception):
    """A user-facing failure carrying a finding. Raised inside onnxmedic, caught by the API."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.one_paragraph())
        self.finding = finding


class InputError(OnnxMedicError):
    """Model or input specs cannot be resolved (stage: inputs)."""


class ResultCodes:
    """``errors`` and ``exit_code`` for a result object with ``ok`` and ``findings``: 0 when
    ok, else the most severe exit code among the errors (3 internal, 2 usage, 1 model/input)."""

    ok: bool
    findings: list[Finding]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == Severity.ERROR]

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        codes = [f.exit_code for f in self.errors]
        return 3 if 3 in codes else 2 if 2 in codes else 1


def listed(items: Any, limit: int, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` (strings) joined by ``sep``, and how many more there
    are: "a, b and 3 more" - for messages naming what they found."""
    items = list(items)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return sep.join(items[:limit]) + more
