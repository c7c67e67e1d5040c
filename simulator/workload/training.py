"""One rank's training iteration as ops: micro-batches (forward + backward), optimizer step, zero_grad.

Where the bytes of mixed precision live follows `framework`:
* torch (autocast): fp32 parameters and gradients, 16-bit copies of weights cached per forward,
  16-bit activations for matmuls; Adam states in the parameter dtype (fp32).
* megatron: 16-bit parameters, a persistent fp32 gradient buffer (main_grad), fp32 main parameters
  and Adam states: 2 + 4 + 4 + 8 = 18 bytes per parameter.
* deepspeed: 16-bit parameters and gradients, fp32 master weights and Adam states: 2 + 2 + 12.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from simulator.errors import PlanError
from simulator.workload.compression import Compression, check_compression
from simulator.workload.data_parallel import (
    DataParallelSetup, LandingPolicy, MicrobatchOps, ParamInfo, apply_data_parallel,
)
from simulator.workload.graph import DTYPE_BYTES, FORWARD, GEMM, GRADIENTS, OPTIMIZER_STATES, OTHER, Op, Tensor
from simulator.workload.loss_scaler import LossScaler, check_loss_scale, make_loss_scaler
from simulator.workload.optimizers import IdSource, MasterParam, optimizer_states, step_ops
from simulator.workload.peft import Adapters, LoraConfig, frozen_dtype
from simulator.workload.primitives import KernelProfile, Ops, annotate_collectives
from simulator.workload.tape import Ref, Tape, numel
from simulator.workload.transformer import Checkpointing, Shape, TransformerBuilder

CPU_RNG_STATE_BYTES = 5056
HALF = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8-mixed": "bf16", "bf16": "bf16"}


@dataclass(frozen=True)
class Recipe:
    """The training options that shape one rank's program."""

    micro_batch_size: int
    accumulation_steps: int
    precision: str
    framework: str
    optimizer: str
    optimizer_implementation: str      # resolved: single-tensor | foreach | fused
    recompute: str
    activation_compression: str = "none"     # "int8": saved activations kept as int8 + row scales
    tp: int = 1                              # tensor-parallel size (Megatron-LM sharding, per rank)
    sequence_parallel: bool = False          # Megatron sequence parallelism (only with tp > 1)
    dp: int = 1                              # data-parallel size (see workload/data_parallel.py)
    zero_stage: int = 0                      # 0 (DDP) | 1 | 2 | 3; megatron: 0 | 1 (distributed optimizer)
    bucket_size_bytes: int = 25_000_000      # gradient bucket size (DDP bucket_cap, DeepSpeed reduce_bucket)
    gradient_compression: str = "none"       # parallel.gradient_compression (workload/compression)
    compression_stage: str = "compressed"    # parallel.gradient_compression_stage: the iteration simulated
    loss_scale: str | float = "dynamic"      # training.loss_scale (fp16-mixed: workload/loss_scaler.py)
    skipped_steps_fraction: float = 0.0      # training.skipped_steps_fraction: steps skipped on overflow
    offload: object | None = None            # offload.state.OffloadConfig when anything is offloaded
    lora: LoraConfig = LoraConfig()          # training.peft: LoRA / QLoRA adapters (workload/peft.py)

    @property
    def compression(self) -> Compression:
        """The data-parallel gradient compression of this recipe."""
        return Compression.parse(self.gradient_compression, self.compression_stage)


@dataclass(frozen=True)
class Dtypes:
    """Where each kind of bytes lives for a (precision, framework) pair."""

    param: str             # the model's parameters
    autocast: str | None   # autocast compute dtype (torch mixed precision) or None
    grad: str              # gradients produced for parameters
    master: str | None     # separate fp32 master copy (megatron/deepspeed), None if the params are updated
    persistent_grad_buffer: bool   # megatron main_grad: gradients accumulate into a persistent buffer


def recipe_dtypes(recipe: Recipe) -> Dtypes:
    """`dtypes_for` the recipe's precision and framework; Bagua (int8 compression) keeps every gradient in its
    persistent flattened buckets, which accumulate like megatron's main_grad."""
    dts = dtypes_for(recipe.precision, recipe.framework)
    if recipe.compression.gradients_in_buckets:
        dts = replace(dts, persistent_grad_buffer=True)
    return dts


def dtypes_for(precision: str, framework: str) -> Dtypes:
    """Resolve the byte conventions of a precision under a framework."""
    if precision == "fp32":
        return Dtypes("fp32", None, "fp32", None, False)
    if precision == "bf16":
        return Dtypes("bf16", None, "bf16", None, False)
    half = HALF[precision] if precision != "fp16-mixed" else "fp16"
    if framework == "megatron":
        return Dtypes(half, None, "fp32", "fp32", True)
    if framework == "deepspeed":
        return Dtypes(half, None, half, "fp32", False)
    return Dtypes("fp32", half, "fp32", None, False)


@dataclass
class IterationWorkload:
    """Everything one rank does in an iteration, with the tensors the ops name."""

    tensors: dict[int, Tensor]
    persistent: tuple[int, ...]                 # parameters, buffers, persistent gradient buffers
    optimizer_state_ids: tuple[int, ...]        # created at the first optimizer step
    microbatch_inputs: tuple[int, ...]          # allocated at the start of each micro-batch
    first_microbatch: list[Op]
    later_microbatch: list[Op]
    optimizer: list[Op]
    gradients: tuple[int, ...]                  # freed by zero_grad(set_to_none=True)
    parameter_count: int
    meta: dict[str, object] = field(default_factory=dict)
    # With data parallelism and gradient accumulation, the last micro-batch synchronizes gradients
    # and the others do not (DDP no_sync): its ops; empty when it runs `later_microbatch` unchanged.
    last_microbatch: list[Op] = field(default_factory=list)
    # Persistent tensors allocated lazily, right before the first run of the op of that name (the cuBLAS
    # workspaces at the first forward and the first backward GEMM): (op name, tensor ids).
    first_use: tuple[tuple[str, tuple[int, ...]], ...] = ()
    host: object | None = None     # offload: the rank's host tensors (offload.state.HostState), None without offload


def _inputs(tape: Tape, shape: Shape, b: int, dt: str) -> tuple[Ref, Ref]:
    if shape.architecture == "resnet":
        pixels = tape.storage("pixels", (b, shape.channels, shape.image, shape.image), dt, OTHER)
        return pixels, tape.storage("targets", (b,), "int64", OTHER)
    if shape.architecture == "vit":
        side = int(round((shape.seq - 1) ** 0.5)) * shape.patch
        image = (b, shape.channels, side, side)
        pixels = tape.storage("pixels", image, dt, OTHER)
        targets = tape.storage("targets", (b,), "int64", OTHER)
        return pixels, targets
    idx = tape.storage("input_ids", (b, shape.seq), "int64", OTHER)
    targets = tape.storage("targets", (b, shape.seq), "int64", OTHER)
    return idx, targets


def _check_data_parallel(recipe: Recipe) -> None:
    if not isinstance(recipe.dp, int) or recipe.dp < 1:
        raise PlanError(f"parallel.dp = {recipe.dp!r} must be a positive integer")
    if recipe.zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"parallel.zero_stage = {recipe.zero_stage!r}: allowed 0, 1, 2, 3")
    if recipe.framework == "megatron" and recipe.zero_stage > 1:
        raise PlanError(f"parallel.zero_stage = {recipe.zero_stage}: framework 'megatron' shards optimizer "
                        f"states only (distributed optimizer); allowed 0, 1")
    if not isinstance(recipe.bucket_size_bytes, int) or recipe.bucket_size_bytes < 1:
        raise PlanError(f"parallel.bucket_size = {recipe.bucket_size_bytes!r} must be a positive number of bytes")
    check_compression(recipe.compression, dp=recipe.dp, zero_stage=recipe.zero_stage, framework=recipe.framework,
                      precision=recipe.precision, optimizer=recipe.optimizer)
    check_loss_scale(recipe.precision, recipe.framework, recipe.loss_scale, recipe.skipped_steps_fraction)


@dataclass(frozen=True)
class ScalerUse:
    """An fp16 loss scaler as a rank's step uses it: the scaler, the gradients it checks, whether the optimizer
    unscales them itself (torch's fused Adam(W)). ZeRO's sharded step re-makes its kernels over the shard."""

    scaler: LossScaler
    params: tuple[MasterParam, ...]
    self_unscaling: bool


@dataclass
class ModelStates:
    """What a rank keeps besides its parameters: workspaces, gradient buffers, optimizer states."""

    persistent: list[int]            # persistent gradient buffers, loss-scaler state
    workspaces: tuple[list[int], list[int]]   # cuBLAS(Lt) workspaces: (forward handle's, autograd thread's)
    grad_buffers: list[int]          # megatron main_grad buffers (empty otherwise), parameter order
    master: list[MasterParam]        # what the optimizer updates, parameter order
    state_tensors: list[Tensor]      # created at the first optimizer step
    optimizer_ops: list[Op]
    loss_scaler: ScalerUse | None = None    # fp16-mixed: the loss scaler and what it unscales


def workspace_first_use(ops: list[Op], workspaces: tuple[list[int], list[int]]
                        ) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """When the cuBLAS workspaces are allocated: the forward handle's before the first forward GEMM, the
    autograd thread's before the first GEMM of the backward pass (a recomputed forward GEMM included)."""
    forward, backward = workspaces
    first_use: list[tuple[str, tuple[int, ...]]] = []
    for wanted, group in ((True, forward), (False, backward)):
        op = next((o for o in ops if o.op_class == GEMM and (o.phase == FORWARD) == wanted), None)
        if group and op is not None:
            first_use.append((op.name, tuple(group)))
    return tuple(first_use)


def model_states(params, dts: Dtypes, recipe: Recipe, profile: KernelProfile, ids: IdSource,
                 tensors: dict[int, Tensor]) -> ModelStates:
    """Declare a rank's persistent non-parameter tensors and its optimizer step (registers tensors)."""
    persistent: list[int] = []
    # torch allocates each cuBLAS handle's workspace through the caching allocator at its first matmul and
    # keeps it: it counts in memory_allocated() for the whole run. The forward thread's handle takes a cuBLAS
    # and a cuBLASLt workspace (two requests), the autograd thread's handle a cuBLAS one.
    cublas = min(profile.backward_workspace_bytes, profile.library_workspace_bytes)
    workspaces: tuple[list[int], list[int]] = ([], [])
    for group, name, nbytes in ((0, "cublas_workspace", cublas or profile.library_workspace_bytes),
                                (0, "cublaslt_workspace", profile.library_workspace_bytes - cublas if cublas else 0),
                                (1, "cublas_workspace.backward", profile.backward_workspace_bytes)):
        if nbytes:
            workspace = Tensor(ids(), name, nbytes, OTHER, "uint8", (nbytes,), persistent=True)
            tensors[workspace.id] = workspace
            workspaces[group].append(workspace.id)
    grad_buffers: list[int] = []
    if dts.persistent_grad_buffer:
        for ref, name in zip(params.refs, params.names):
            tensor = Tensor(ids(), f"{name}.main_grad", numel(ref.shape) * DTYPE_BYTES[dts.grad],
                            GRADIENTS, dts.grad, ref.shape, persistent=True)
            tensors[tensor.id] = tensor
            grad_buffers.append(tensor.id)
        persistent += grad_buffers
    master = [MasterParam(name, ref.shape, numel(ref.shape), dts.master or ref.dtype, dts.grad)
              for ref, name in zip(params.refs, params.names)]
    state_tensors: list[Tensor] = []
    compression = recipe.compression
    if compression.kind == "1bit":
        from simulator.workload.compression.onebit import onebit_optimizer    # here: only 1-bit Adam loads it

        # DeepSpeed's 1-bit Adam replaces the optimizer (and, under fp16, updates one flat fp32 master).
        state_tensors, opt_ops = onebit_optimizer(master, dts.master is not None, recipe.dp, compression.compressing,
                                                  ids, tensors)
    else:
        if dts.master:
            for p in master:
                state_tensors.append(Tensor(ids(), f"{p.name}.master", p.numel * DTYPE_BYTES[dts.master],
                                            OPTIMIZER_STATES, dts.master, p.shape, persistent=True))
        state_tensors += optimizer_states(recipe.optimizer, master, ids, profile.device_kind == "cpu")
        for tensor in state_tensors:
            tensors[tensor.id] = tensor
        opt_ops = step_ops(recipe.optimizer, recipe.optimizer_implementation, master, ids, tensors)
    use = None
    if recipe.precision == "fp16-mixed":
        scaler = make_loss_scaler(recipe.framework, recipe.loss_scale, ids, tensors)
        persistent += scaler.state
        use = ScalerUse(scaler, tuple(master), recipe.framework == "torch" and recipe.optimizer == "adamw"
                        and recipe.optimizer_implementation == "fused")
        before, after = scaler.ops(master, ids, tensors, self_unscaling=use.self_unscaling)
        opt_ops = before + opt_ops + after
    return ModelStates(persistent, workspaces, grad_buffers, master, state_tensors, opt_ops, use)


def build_iteration(shape: Shape, recipe: Recipe, profile: KernelProfile, offload=None) -> IterationWorkload:
    """Build the ops of one training iteration on one rank (no pipeline parallelism).

    With `recipe.tp` > 1 the rank holds its tensor-parallel shards and its ops include the
    tensor-parallel collectives (op class COLLECTIVE, group "tp"); the persistent all_gather
    buffer of sequence parallelism is allocated with the parameters. With `recipe.dp` > 1 the
    rank's gradient synchronization and ZeRO sharding (`recipe.zero_stage`) are added as
    data_parallel.py describes (collectives of group "dp"); dp = 1 is the single-device program.

    `offload`: what applies `recipe.offload` (its `host_saver()` and `apply(...)`), needed when recipe.offload is
    set. The offload package builds on this one, so it hands itself in: simulator.offload.apply.build_iteration.
    """
    if recipe.offload is not None and offload is None:
        raise PlanError("build_iteration: recipe.offload is set but offload= is not given "
                        "(simulator.offload.apply.build_iteration passes it)")
    _check_data_parallel(recipe)
    dts = recipe_dtypes(recipe)
    b = recipe.micro_batch_size
    compress = recipe.activation_compression == "int8"
    # torch.utils.checkpoint stashes the CPU generator state (5,056 bytes, measured on torch 2.13);
    # on a GPU that tensor lives in host memory and costs the device nothing.
    rng_bytes = CPU_RNG_STATE_BYTES if profile.device_kind == "cpu" else 0
    tape = Tape(microbatch=0, compress_saved=compress, rng_state_bytes=rng_bytes)
    tape.saver = _host_saver(recipe, offload)
    fp8 = recipe.precision == "fp8-mixed"
    ops = Ops(tape, profile, dts.autocast, fp8_linear=fp8, tp=recipe.tp,
              sequence_parallel=recipe.sequence_parallel)
    adapters = None
    build_dtype = dts.param
    if recipe.lora.enabled:
        build_dtype = frozen_dtype(dts.param, dts.autocast)
        adapters = Adapters(recipe.lora, ops, dts.param, build_dtype)
        ops.frozen_aware = True
    builder = make_builder(ops, shape, build_dtype, Checkpointing(recipe.recompute), b, adapters)
    # A data loader hands a CNN fp32 images (autocast casts them for the first conv).
    input_dtype = dts.param if shape.architecture == "resnet" else dts.autocast or dts.param
    if shape.architecture == "dlrm":
        inputs = builder.inputs()
        idx, targets = inputs, None
    else:
        idx, targets = _inputs(tape, shape, b, input_dtype)
        inputs = (idx, targets)
    loss = builder.forward(idx, targets)
    # Communication buffers are created on first use during the forward.
    frozen = adapters.frozen if adapters is not None else []
    persistent_refs = builder.params.refs + frozen + builder.buffers + ops.comm_buffers
    policy = LandingPolicy(dts.persistent_grad_buffer)
    first_ops, tensors = policy.finish(tape, loss)
    first_ops = annotate_collectives(first_ops, ops.collectives)
    tensors = dict(tensors)
    grads = [g.id for g in policy.grads]
    later_ops: list[Op] = []
    later_policy: LandingPolicy | None = None
    next_id = max(tensors) + 1 if tensors else tape.next_tensor_id
    if recipe.accumulation_steps > 1:
        # Later micro-batches accumulate into the existing gradients: same forward, new tensor ids.
        tape2 = Tape(microbatch=1, first_tensor_id=next_id, compress_saved=compress,
                     rng_state_bytes=rng_bytes)
        tape2.saver = tape.saver
        tape2._storages.update({ref.id: tape._storages[ref.id] for ref in persistent_refs})
        tape2._storages.update({ref.id: tape._storages[ref.id] for ref in inputs})
        ops2 = Ops(tape2, profile, dts.autocast, fp8_linear=fp8, tp=recipe.tp,
                   sequence_parallel=recipe.sequence_parallel, comm_buffers=ops._comm_buffers)
        ops2.frozen_aware = ops.frozen_aware
        builder.ops, builder.tape = ops2, tape2
        if adapters is not None:
            adapters.ops = ops2
        loss2 = builder.forward(idx, targets)
        # ZeRO-2/3 release each gradient once it is reduced: every micro-batch produces a fresh `.grad`.
        later_policy = LandingPolicy(dts.persistent_grad_buffer or recipe.dp == 1 or recipe.zero_stage < 2)
        later_ops, tensors2 = later_policy.finish(tape2, loss2)
        later_ops = annotate_collectives(later_ops, ops2.collectives)
        tensors.update(tensors2)
        next_id = max(tensors) + 1
    ids = IdSource(max(next_id, tape.next_tensor_id))
    # Persistent tensors: parameters and buffers as declared on the tape.
    for ref in persistent_refs:
        st = tape._storages[ref.id]
        tensors[ref.id] = Tensor(ref.id, st.name, ref.nbytes, st.category, ref.dtype, ref.shape,
                                 persistent=True)
    for ref in inputs:
        tensors[ref.id] = Tensor(ref.id, tape._storages[ref.id].name, ref.nbytes, OTHER, ref.dtype, ref.shape)
    persistent = [ref.id for ref in persistent_refs]
    params = builder.params
    states = model_states(params, dts, recipe, profile, ids, tensors)
    persistent += states.persistent
    grad_buffers = states.grad_buffers
    state_tensors, opt_ops = states.state_tensors, states.optimizer_ops
    first_use = workspace_first_use(first_ops, states.workspaces)
    # Gradients stolen into .grad are per-iteration tensors of category "gradients".
    for gid in grads:
        t = tensors[gid]
        tensors[gid] = Tensor(t.id, t.name, t.nbytes, GRADIENTS, t.dtype, t.shape)
    workload = IterationWorkload(
        tensors=tensors,
        persistent=tuple(persistent),
        optimizer_state_ids=tuple(t.id for t in state_tensors),
        microbatch_inputs=tuple(ref.id for ref in inputs),
        first_microbatch=first_ops,
        later_microbatch=later_ops,
        optimizer=opt_ops,
        gradients=tuple(grads),
        parameter_count=sum(numel(r.shape) for r in params.refs) + (adapters.frozen_count if adapters else 0),
        meta={"dtypes": dts, "tp": recipe.tp, "sequence_parallel": ops.sp, "loss_scaler": states.loss_scaler,
              **({"host_embeddings": (shape.dlrm, b)} if getattr(builder, "pooled", None) is not None else {}),
              **({"trainable_parameters": sum(numel(r.shape) for r in params.refs),
                  "frozen_ids": tuple(ref.id for ref in frozen)} if adapters else {})},
        first_use=first_use,
    )
    zero_on_one = recipe.offload is not None and recipe.zero_stage > 0   # DeepSpeed's ZeRO runs on one GPU too
    if recipe.dp == 1 and not zero_on_one:
        return _offloaded(workload, recipe, params, ids, tape.saver, offload)
    setup = DataParallelSetup(recipe.dp, recipe.zero_stage, recipe.framework, recipe.bucket_size_bytes,
                              recipe.accumulation_steps, recipe.optimizer, recipe.optimizer_implementation,
                              profile.device_kind == "cpu", dts.param, dts.master, recipe.compression)
    infos = [ParamInfo(ref.id, name, numel(ref.shape), dts.grad,
                       grad_buffers[k] if grad_buffers else None, tuple(ref.shape))
             for k, (ref, name) in enumerate(zip(params.refs, params.names))]
    lists = MicrobatchOps(first_ops, policy, later_ops, later_policy)
    return _offloaded(apply_data_parallel(workload, setup, infos, lists, ids), recipe, params, ids, tape.saver,
                      offload)


def make_builder(ops: Ops, shape: Shape, param_dtype: str, checkpointing: Checkpointing, b: int,
                 adapters: Adapters | None = None):
    """The whole-model builder of the architecture: a ResNet (workload/resnet.py), a DLRM (workload/dlrm.py) or a
    transformer (with LoRA / QLoRA `adapters`: api refuses them for the others)."""
    if shape.architecture == "resnet":
        from simulator.workload.resnet import ResNetBuilder

        return ResNetBuilder(ops, shape, param_dtype, checkpointing, b)
    if shape.architecture == "dlrm":
        from simulator.workload.dlrm import DLRMBuilder

        return DLRMBuilder(ops, shape, param_dtype, checkpointing, b)
    return TransformerBuilder(ops, shape, param_dtype, checkpointing, b, adapters=adapters)


def _host_saver(recipe: Recipe, offload):
    """save_on_cpu's hooks for the tapes when activations are offloaded (offload/activations.py), else None."""
    if recipe.offload is None or recipe.offload.activations != "cpu":
        return None
    return offload.host_saver()


def _offloaded(workload: IterationWorkload, recipe: Recipe, params, ids: IdSource, saver, offload) -> IterationWorkload:
    """The workload with recipe.offload applied (by `offload`: simulator/offload), or as it is without offload."""
    if recipe.offload is None:
        return workload
    return offload.apply(workload, recipe.offload, max(numel(ref.shape) for ref in params.refs), ids, saver,
                         optimizer=recipe.optimizer)
