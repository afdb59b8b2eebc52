"""The CUDA branch of `backends.weights.Weights`, checked without a GPU (none on these machines):
a recording stand-in for torch and its tensors shows which copies, pins and synchronisations
the host tier asks of CUDA. The real copies are tested on CPU tensors in
tests/integration/test_reward_backends.py; on a GPU host the reward e2e tests run this branch."""

from __future__ import annotations

from typing import Any

from reward_servers.backends.weights import Weights


class FakeTensor:
    def __init__(self, log: list[tuple[Any, ...]], name: str, device: str, pinned: bool = False) -> None:
        self.log, self.name, self.device, self.pinned = log, name, device, pinned
        self.shape, self.dtype = (4, 4), "float16"
        self.data: FakeTensor = self

    def numel(self) -> int:
        return 16

    def element_size(self) -> int:
        return 2

    def detach(self) -> FakeTensor:
        return self

    def copy_(self, src: FakeTensor) -> FakeTensor:
        self.log.append(("copy", src.device, "->", self.device, self.pinned))
        return self

    def to(self, device: str, non_blocking: bool = False) -> FakeTensor:
        self.log.append(("to", self.device, "->", device, self.pinned, non_blocking))
        return FakeTensor(self.log, self.name, device)


class FakeCuda:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def synchronize(self, device: str) -> None:
        self.log.append(("synchronize", device))

    def empty_cache(self) -> None:
        self.log.append(("empty_cache",))


class FakeTorch:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log, self.cuda = log, FakeCuda(log)

    def empty(self, shape: Any, dtype: Any, device: str, pin_memory: bool) -> FakeTensor:
        return FakeTensor(self.log, "host", device, pinned=pin_memory)


class FakeModule:
    def __init__(self, params: list[FakeTensor]) -> None:
        self.params = params

    def parameters(self) -> list[FakeTensor]:
        return self.params

    def buffers(self) -> list[FakeTensor]:
        return []


def test_cuda_weights_are_pinned_at_load_and_copied_back_asynchronously_then_synchronised() -> None:
    log: list[tuple[Any, ...]] = []
    shared = FakeTensor(log, "w", "cuda:1")
    module = FakeModule([shared, FakeTensor(log, "b", "cuda:1")])
    tied = FakeModule([shared])  # the same Parameter in a second module moves once
    w = Weights(FakeTorch(log), [module, tied], "cuda:1")
    assert len(w.tensors) == 2 and w.nbytes == 64 and w.on_device
    assert log == [("copy", "cuda:1", "->", "cpu", True)] * 2  # one pinned host copy each, at load
    log.clear()
    w.offload()
    assert all(t.data.device == "cpu" and t.data.pinned for t in w.tensors)
    assert log == [("synchronize", "cuda:1"), ("empty_cache",)]  # the device memory goes back
    log.clear()
    w.restore()
    assert log == [("to", "cpu", "->", "cuda:1", True, True)] * 2 + [("synchronize", "cuda:1")]
    assert all(t.data.device == "cuda:1" for t in w.tensors) and w.on_device
    log.clear()
    w.restore()  # already there: nothing moves
    assert log == []
