"""What an offloading rank adds to its workload: its host tensors, when they are allocated, its host CPU rates."""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.offload.host_memory import HostTensor

# DRAM bytes per element of CPU-Adam over fp32 states (DeepSpeed csrc/adam/cpu_adam_impl.cpp Step_AVX: loads the
# parameter, gradient, exp_avg and exp_avg_sq; stores the parameter, exp_avg and exp_avg_sq).
ADAM_HOST_BYTES_PER_ELEMENT = 28
ADAM = "adam"          # host kernel: CPU-Adam (rate: host.cpu_adam_elements_per_s)
STREAM = "stream"      # host kernel: streaming element-wise work (rate: host.cpu_stream_bytes_per_s)


@dataclass(frozen=True)
class OffloadConfig:
    """The offload options of one rank, resolved: where each kind of state goes and the host rates it gets.

    `adam_bytes_per_s` and `stream_bytes_per_s` are this rank's share of its server's CPU (the server's rate over the
    ranks on it, each process on its share of the cores, as DeepSpeed's --bind_cores_to_rank launches them), as DRAM
    traffic: CPU-Adam's elements per second times ADAM_HOST_BYTES_PER_ELEMENT.
    """

    optimizer: str = "none"          # none | cpu | nvme
    params: str = "none"
    activations: str = "none"
    prefetch_bucket_elements: int = 50_000_000
    adam_bytes_per_s: float = 0.0
    stream_bytes_per_s: float = 0.0
    embeddings: str = "device"       # device | host (model.embedding_placement of a DLRM: offload/embeddings.py)

    @property
    def enabled(self) -> bool:
        """Whether anything is offloaded."""
        return "cpu" in (self.optimizer, self.params, self.activations) or \
            "nvme" in (self.optimizer, self.params, self.activations) or self.embeddings == "host"


@dataclass
class HostState:
    """A rank's host side: its host tensors by id, those allocated at set-up and at the first optimizer step, and the
    bytes/s each host kernel gets (`caps`, for the lowering)."""

    tensors: dict[int, HostTensor] = field(default_factory=dict)
    persistent: tuple[int, ...] = ()
    first_step: tuple[int, ...] = ()
    caps: dict[str, float] = field(default_factory=dict)

    def add(self, tensor: HostTensor, when: str) -> int:
        """Register `tensor`; `when` is "persistent", "first_step" or "" (allocated by a transfer); returns its id."""
        self.tensors[tensor.id] = tensor
        if when == "persistent":
            self.persistent += (tensor.id,)
        elif when == "first_step":
            self.first_step += (tensor.id,)
        return tensor.id
