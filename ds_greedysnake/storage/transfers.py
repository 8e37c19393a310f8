"""Host<->device copies on transfer streams of their own (one per direction), each guarded by an event;
and host memory the device copies from without a bounce.

On a GPU every host<->device copy the engine makes goes through ``Transfers``:

* ``to_device(host)`` enqueues the copy on the inbound stream and makes the compute stream wait for it
  (on the GPU, not on the CPU): the compute kernels enqueued before it keep running while the copy
  runs. It returns the device tensor and a ``Guard`` that travels with the host buffer: the buffer may
  be reused (by an aio read, or the CPU) only once ``guard.wait()`` returned.
* ``to_host(device, host)`` makes the outbound stream wait for the compute enqueued so far (the
  producer of ``device``), enqueues the copy into ``host`` and returns a ``Guard``: the host buffer is
  readable, and ``device`` may be freed, once it completed. The guard keeps ``device`` alive until
  then, so the caching allocator cannot hand its memory to new compute while the copy still reads it.
  At most ``max_pending_to_host`` such copies are left pending: one more waits for the oldest first,
  which bounds the device memory held by copies in flight, whatever the number of micro-batches. It is
  also how far the host may run ahead of the device's outbound copies before it waits: with 2 the host
  waited on nearly every micro-batch's checkpoint (the device is always a little behind), so it is 4
  (``PENDING_TO_HOST``): four checkpoints or gradients of device memory at most.
* A copy into or from a host buffer waits, on the device, for the last copy in the other direction
  that touched it: a buffer is never rewritten while a copy reads it, nor read while one writes it.

Host buffers come from ``host_buffer``: page-aligned memory registered with the accelerator at its
exact size (DeepSpeed's ``register_host_memory``; CUDA: ``cudaHostRegister``), not through torch's
caching host allocator, which rounds every pinned request up to a power of two (a 2 GiB + 8 KiB buffer
pins 4 GiB) and, through ``Tensor.pin_memory()``, allocates pageable memory first and copies it.

On the CPU accelerator the device is the host: ``to_device`` hands back the host tensor itself,
``to_host`` copies at once, every guard is complete. That is exactly what the engine did before this
module existed, so CPU results are bitwise unchanged.

The streams are created once per device (``Transfers.for_device``); the accelerator's stream and event
API is reached through ``get_accelerator()`` behind ``AcceleratorStreams``, which tests replace by a fake.
"""
import weakref
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

PAGE_BYTES = 4096


class AcceleratorStreams:
    """The two transfer streams and the events ``Transfers`` needs, from DeepSpeed's accelerator: one
    stream per direction, so that a copy to the host waiting for the compute that produces its data
    never holds up a copy to the device queued after it (and both directions of the link work at once)."""

    def __init__(self, device: torch.device, accelerator=None):
        self._accelerator = accelerator or get_accelerator()
        self._device = device
        self.inbound = self._accelerator.Stream(device=device)   # host -> device
        self.outbound = self._accelerator.Stream(device=device)  # device -> host
        # The all-gathers of layer weights over the ranks (``Transfers.gather_to_device``): on the compute
        # stream, a gather would start only once all compute queued before it ran, so a layer's weights
        # could never be gathered while the layer before it computes.
        self.gather = self._accelerator.Stream(device=device)

    def current(self):
        return self._accelerator.current_stream(self._device)

    def on(self, stream):
        """Context in which work is enqueued on ``stream``."""
        return self._accelerator.stream(stream)

    def record(self, stream):
        event = self._accelerator.Event()
        event.record(stream)
        return event

    @staticmethod
    def keep_for(tensor: torch.Tensor, stream) -> None:
        """The caching allocator must not reuse ``tensor``'s memory before ``stream``'s work on it ran."""
        tensor.record_stream(stream)

    @staticmethod
    def read_values(tensor: torch.Tensor) -> list:
        """The values of a small device tensor on the host: the host waits for the device's work so far."""
        return tensor.tolist()

    def timing_event(self, stream):
        """An event that records when ``stream`` reached it on the device (for ``elapsed_seconds``)."""
        event = self._accelerator.Event(enable_timing=True)
        event.record(stream)
        return event

    @staticmethod
    def elapsed_seconds(start, end) -> float:
        """Device time between two completed timing events."""
        return start.elapsed_time(end) / 1000.0  # milliseconds

    def synchronize(self) -> None:
        """The host waits for all the device's work so far."""
        self._accelerator.synchronize(self._device.index)


class Guard:
    """Completion of one copy on a transfer stream. ``wait`` blocks the CPU until it ran (idempotent) and
    then drops what the copy needed alive; ``done`` asks without blocking; ``order_before`` makes a
    stream wait for it on the device."""

    def __init__(self, event=None, keep_alive: Optional[torch.Tensor] = None):
        self._event = event
        self._keep_alive = keep_alive

    def done(self) -> bool:
        if self._event is None:
            return True
        if self._event.query():
            self._release()
            return True
        return False

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._release()

    def order_before(self, stream) -> None:
        if not self.done():
            stream.wait_event(self._event)

    def _release(self) -> None:
        self._event, self._keep_alive = None, None


COMPLETE = Guard()
PENDING_TO_HOST = 4  # copies to the host in flight before the host waits for the oldest (module docstring)


class Transfers:
    """Copies between host and ``device`` (see the module docstring); ``streams`` None: the device is
    the host."""

    def __init__(self, device: torch.device, streams: Optional[AcceleratorStreams] = None,
                 max_pending_to_host: int = PENDING_TO_HOST):
        self.device = device
        self._streams = streams
        self._max_pending_to_host = max_pending_to_host
        self._pending_to_host: Deque[Guard] = deque()
        # The last copy from or into each host buffer (by address): a copy in the other direction waits
        # for it on the device, so a buffer is never rewritten while read, nor read while written.
        self._last_copy: Dict[int, Guard] = {}
        self._last_copy_pruned_at = _PRUNE_LAST_COPIES_FROM  # its size when completed guards were last dropped

    @classmethod
    def for_device(cls, device: torch.device) -> "Transfers":
        """The one instance (and so the one pair of transfer streams) of ``device``."""
        key = str(device)
        if key not in _INSTANCES:
            _INSTANCES[key] = cls(device, None if device.type == "cpu" else AcceleratorStreams(device))
        return _INSTANCES[key]

    @property
    def device_is_host(self) -> bool:
        return self._streams is None

    def read_values(self, tensor: torch.Tensor) -> list:
        """``tensor``'s values as Python numbers: one wait of the host for the device (the only kind of wait a
        step makes outside guards), so callers gather what they need into one tensor and read it once."""
        if self._streams is None:
            return tensor.tolist()
        return self._streams.read_values(tensor)

    def to_device(self, host: torch.Tensor, consumer=None) -> Tuple[torch.Tensor, Guard]:
        """A device copy of ``host``, which compute enqueued from now on waits for (or, given, the work
        enqueued on stream ``consumer``); the guard says when ``host`` may be overwritten. On the CPU
        accelerator, ``host`` itself."""
        if self._streams is None:
            return host, COMPLETE
        streams = self._streams
        compute = streams.current() if consumer is None else consumer
        self._after_last_copy_of(host, streams.inbound)
        with streams.on(streams.inbound):
            # Allocated on the inbound stream: its memory is free there; used on the compute stream next.
            on_device = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            on_device.copy_(host, non_blocking=True)
            copied = streams.record(streams.inbound)
        compute.wait_event(copied)
        streams.keep_for(on_device, compute)
        guard = Guard(copied, host)
        self._remember_last_copy(host, guard)
        return on_device, guard

    def gather_to_device(self, host: torch.Tensor,
                         gather: Callable[[torch.Tensor], List[torch.Tensor]]) -> Tuple[List[torch.Tensor], Guard, Guard]:
        """``gather(shard)`` of a device copy ``shard`` of ``host``: a collective over the ranks (and the
        device copies that split its result), run on the gather stream once the copy ran, not after the
        compute queued so far. Returns its tensors, the guard of ``host`` (as ``to_device``'s) and the
        guard of the gather, which the compute must wait for before reading them (``compute_waits_for``).
        On the CPU accelerator, ``gather(host)`` as it is, both guards complete.

        What orders the collective on the gather stream: torch.distributed's synchronous collectives
        (``async_op=False``, as deepspeed.comm calls them) are ordered against the stream *current at the
        call*: ProcessGroupNCCL either enqueues the NCCL kernel on that stream itself (recent torch's
        ``collective()``: "in asyncOp=false [default] mode, we use currentStream as ncclStream") or, in
        older versions, makes its internal NCCL stream wait for an event recorded on the current stream
        (``syncStream``) and then, in ``work.wait()``, makes the current stream wait for the collective's end
        event. Both are device-side waits. So under ``streams.on(gather)`` the collective runs after what
        the gather stream waited for (the copy's event) and before the event recorded after it. Collectives
        of one communicator on different streams (gathers here, reduce-scatters on the compute stream) run
        in the order they were issued, the same on every rank: NCCL makes each launch wait for the
        communicator's previous kernel (its internal ``deviceStream``, ``enqueue.cc``). gloo (the CPU
        accelerator) is synchronous on the host."""
        if self._streams is None:
            return gather(host), COMPLETE, COMPLETE
        streams = self._streams
        compute = streams.current()
        # The gather stream waits for the copy's event (and keeps the copy's memory for its own use).
        shard, copied = self.to_device(host, consumer=streams.gather)
        with streams.on(streams.gather):
            gathered = gather(shard)  # allocated on the gather stream
            done = streams.record(streams.gather)
        for tensor in gathered:
            streams.keep_for(tensor, compute)  # read by the compute next
        return gathered, copied, Guard(done)

    def compute_waits_for(self, guard: Guard) -> None:
        """The compute enqueued from now on waits, on the device, for ``guard``'s work (the host does not)."""
        if self._streams is not None:
            guard.order_before(self._streams.current())

    def mark_compute(self):
        """A timing event recorded on the compute stream now (no wait), for ``elapsed_seconds``; None where
        the device is the host (the host's clock then times the compute)."""
        if self._streams is None:
            return None
        return self._streams.timing_event(self._streams.current())

    def elapsed_seconds(self, marks: List[Tuple[object, object]]) -> List[float]:
        """The device time between each (start, end) pair of ``mark_compute`` events: one wait of the host
        for the device, whatever the number of pairs."""
        if not marks:
            return []
        self._streams.synchronize()
        return [self._streams.elapsed_seconds(start, end) for start, end in marks]

    def to_host(self, on_device: torch.Tensor, host: torch.Tensor) -> Guard:
        """Copy ``on_device`` into ``host`` once the compute enqueued so far ran; read ``host`` (or free
        ``on_device``'s memory for good) only after the guard's ``wait``. On the CPU accelerator the copy
        is done when this returns."""
        if self._streams is None:
            host.copy_(on_device)
            return COMPLETE
        while self._pending_to_host and (self._pending_to_host[0].done()
                                         or len(self._pending_to_host) >= self._max_pending_to_host):
            self._pending_to_host.popleft().wait()
        streams = self._streams
        streams.outbound.wait_event(streams.record(streams.current()))
        self._after_last_copy_of(host, streams.outbound)
        with streams.on(streams.outbound):
            host.copy_(on_device, non_blocking=True)
            copied = streams.record(streams.outbound)
        guard = Guard(copied, on_device)
        self._pending_to_host.append(guard)
        self._remember_last_copy(host, guard)
        return guard

    def host_copy(self, on_device: torch.Tensor, host: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Guard]:
        """``on_device`` in host memory: into ``host`` (registered memory of its shape and dtype) when given,
        else into a new registered tensor. On the CPU accelerator, ``on_device`` itself (as ``.to("cpu")``)."""
        if self._streams is None:
            return on_device, COMPLETE
        if host is None:
            host = host_tensor(on_device.shape, on_device.dtype)
        return host, self.to_host(on_device, host)

    def _after_last_copy_of(self, host: torch.Tensor, stream) -> None:
        previous = self._last_copy.get(host.data_ptr())
        if previous is not None:
            previous.order_before(stream)

    def _remember_last_copy(self, host: torch.Tensor, guard: Guard) -> None:
        """Each guard keeps its copy's source alive until polled: a host buffer that is never copied again
        (a slot replaced after a shape change) would otherwise stay alive, and registered, for good. So once
        the table doubled, the guards that completed are polled and dropped (without waiting for any)."""
        self._last_copy[host.data_ptr()] = guard
        if len(self._last_copy) >= 2 * self._last_copy_pruned_at:
            self._last_copy = {address: kept for address, kept in self._last_copy.items() if not kept.done()}
            self._last_copy_pruned_at = max(_PRUNE_LAST_COPIES_FROM, len(self._last_copy))

    def pending_copies(self) -> int:
        """How many host buffers a copy still in flight reads or writes (for tests and leaks)."""
        return sum(1 for guard in self._last_copy.values() if not guard.done())


_INSTANCES: Dict[str, Transfers] = {}
_PRUNE_LAST_COPIES_FROM = 64


# ----------------------------------------------------------------------------- registered host memory


def host_buffer(num_bytes: int, alignment: int = PAGE_BYTES) -> torch.Tensor:
    """A ``num_bytes`` uint8 host tensor whose first byte is ``alignment``-aligned, registered (pinned) with
    the accelerator at its exact size where it pins memory; plain memory on the CPU accelerator.

    The memory is a numpy allocation (never touched before registration) that the tensor keeps alive;
    it is unregistered when the last tensor viewing it is gone, before numpy frees it."""
    padded = -(-num_bytes // PAGE_BYTES) * PAGE_BYTES
    array = numpy.empty(padded + max(alignment, PAGE_BYTES), dtype=numpy.uint8)
    base = torch.from_numpy(array)
    offset = (-base.data_ptr()) % max(alignment, PAGE_BYTES)
    buffer = base[offset:offset + num_bytes]
    assert buffer.data_ptr() % alignment == 0
    try:
        unregister = register_host_memory(buffer.data_ptr(), padded)
    except MemoryError as error:
        logger.warning(f"greedysnake: {error}; pinning {num_bytes} bytes through torch instead (rounded up)")
        return _fallback_pinned(num_bytes, alignment)
    if unregister is not None:
        # Not at interpreter exit: the process's memory goes with it, and the runtime may be gone first.
        weakref.finalize(array, unregister).atexit = False
    elif get_accelerator().device_name() != "cpu":
        # Another accelerator: its own pinning (through its caching allocator, rounded up), better than none.
        return _fallback_pinned(num_bytes, alignment)
    return buffer


def host_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """A registered host tensor of ``shape`` and ``dtype`` (see ``host_buffer``)."""
    numel = 1
    for size in shape:
        numel *= size
    element = torch.empty(0, dtype=dtype).element_size()
    return host_buffer(numel * element)[:numel * element].view(dtype).view(shape)


def register_host_memory(address: int, num_bytes: int) -> Optional[Callable[[], None]]:
    """Page-lock ``num_bytes`` of existing host memory at ``address`` for the accelerator's copy engines
    (DeepSpeed's ``register_host_memory``: ``cudaHostRegister`` on CUDA); returns what unregisters it, or
    None where the accelerator registers nothing (the CPU accelerator: nothing to pin for). The memory
    must outlive the registration."""
    accelerator = get_accelerator()
    if num_bytes == 0:
        return None
    try:
        registered = accelerator.register_host_memory(address, num_bytes)
    except Exception as error:  # the runtime's own error type (torch.cuda.CudaError)
        cleared = clear_runtime_error(accelerator)
        raise MemoryError(f"registering {num_bytes} bytes of host memory with the {accelerator.device_name()} runtime "
                          f"failed ({error}): raise the memlock limit (ulimit -l unlimited) or lower greedysnake's "
                          f"host-memory budgets{cleared}") from error
    if not registered:
        return None

    def unregister() -> None:
        accelerator.unregister_host_memory(address)

    return unregister


def clear_runtime_error(accelerator) -> str:
    """Read back (and so clear) the error a failed registration left as the CUDA runtime's last error.

    ``cudaHostRegister`` failing sets the runtime's last error; DeepSpeed's wrapper raises, but leaves it
    set, and torch's check after the next kernel launch (``cudaGetLastError``) would then report it from
    an unrelated kernel, failing a step that has nothing wrong. Reading it here ends that; the error itself
    is what the caller raises (or falls back from). Returns a note for the message; "" off CUDA."""
    if accelerator.device_name() != "cuda":
        return ""
    leftover = torch.cuda.cudart().cudaGetLastError()
    return f" (runtime error {int(leftover)} read back and cleared)" if int(leftover) else ""


def _fallback_pinned(num_bytes: int, alignment: int) -> torch.Tensor:
    base = get_accelerator().pin_memory(torch.empty(num_bytes + alignment, dtype=torch.uint8))
    offset = (-base.data_ptr()) % alignment
    return base[offset:offset + num_bytes]
