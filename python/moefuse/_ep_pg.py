"""An EpGroup's unique id through a torch.distributed process group (EpGroup.from_process_group).

One all_gather of a fixed-size record per rank carries rank 0's NCCL id to every rank, and with
it each rank's own refusal (an argument, a context that has no NCCL) and its view of the
experts' placement. Every rank then decides alike: all raise, or all go on to
moefuse_ep_group_create. A rank that raised alone would leave the others waiting in NCCL's
set-up, which has no time-out.
"""

import ctypes
import struct
import zlib

from . import _capi, _capi_ep, errors
from ._capi import lib, text

_HEAD = struct.Struct("<qqqI")  # kind, status, num_experts, placement checksum
_MESSAGE_BYTES = 512 - _HEAD.size - _capi_ep.UNIQUE_ID_BYTES
RECORD_BYTES = 512

OK, ARGUMENT, REFUSED = 0, 1, 2  # record kinds: ARGUMENT is the caller's, REFUSED the library's


def placement_checksum(owner):
    """A checksum of expert_owner (a list of ints, or None for equal blocks) to compare ranks."""
    if owner is None:
        return 0xFFFFFFFF
    return zlib.crc32(struct.pack(f"<{len(owner)}i", *owner))


def _pack(kind, status, num_experts, checksum, uid, message):
    msg = message.encode("utf-8", "replace")[:_MESSAGE_BYTES]
    raw = _HEAD.pack(kind, status, num_experts, checksum) + uid + msg
    return raw + bytes(RECORD_BYTES - len(raw))


def _unpack(raw):
    kind, status, num_experts, checksum = _HEAD.unpack_from(raw)
    start = _HEAD.size + _capi_ep.UNIQUE_ID_BYTES
    uid = raw[_HEAD.size:start]
    message = raw[start:].rstrip(b"\0").decode("utf-8", "ignore")
    return kind, status, num_experts, checksum, uid, message


def local_record(ctx, rank, placement):
    """This rank's record, and the exception it raises itself if any rank refuses (None).

    placement: (num_experts, owner list or None), or the exception checking them raised.
    Rank 0 makes the id. A rank whose context is not CUDA asks the library for an id too,
    only to get the library's own refusal (no NCCL is touched on those backends)."""
    if isinstance(placement, BaseException):
        message = getattr(placement, "message", None) or str(placement)
        return _pack(ARGUMENT, errors.code_of("MOEFUSE_ERR_INVALID_ARGUMENT"), -1, 0,
                     bytes(_capi_ep.UNIQUE_ID_BYTES), message), placement
    num_experts, owner = placement
    checksum = placement_checksum(owner)
    uid = bytes(_capi_ep.UNIQUE_ID_BYTES)
    if rank == 0 or ctx.backend != "cuda":
        made = _capi_ep.UniqueId()
        with ctx._lock:
            status = _capi_ep.functions["moefuse_ep_unique_id_create"](ctx.handle,
                                                                       ctypes.byref(made))
            message = text(lib.moefuse_last_error(ctx.handle))
        if status != _capi.OK:
            own = errors.make(status, message)
            return _pack(REFUSED, status, num_experts, checksum, uid, message), own
        if rank == 0:
            uid = bytes(made)  # the whole 128 bytes: NCCL's id may hold zero bytes
    return _pack(OK, 0, num_experts, checksum, uid, ""), None


def exchange(record, process_group):
    """Every rank's record, through one all_gather on the group (a CUDA tensor for NCCL)."""
    import torch
    import torch.distributed as dist
    if dist.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mine = torch.tensor(list(record), dtype=torch.uint8, device=device)
    world = dist.get_world_size(process_group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=process_group)
    return [bytes(t.cpu().tolist()) for t in everyone]


def _first(parsed, kind):
    return next((r for r, p in enumerate(parsed) if p[0] == kind), None)


def _raise(own, first, records, what):
    """Raise on every rank: a rank's own exception, else one naming the rank that refused."""
    if own is not None:
        raise own
    _, status, _, _, _, message = records[first]
    raise errors.make(status, f"EpGroup.from_process_group: rank {first} refused {what} "
                              f"({message}); every rank of the group stops with it")


def decide(rank, own, records):
    """The id every rank makes its group from; or the same refusal on every rank: the
    caller's arguments first, then ranks that disagree on the placement, then the library's
    refusals."""
    parsed = [_unpack(r) for r in records]
    first = _first(parsed, ARGUMENT)
    if first is not None:
        _raise(own if parsed[rank][0] == ARGUMENT else None, first, parsed, "its arguments")
    base = parsed[0]
    differ = [r for r, p in enumerate(parsed) if (p[2], p[3]) != (base[2], base[3])]
    if differ:
        said = ", ".join(f"rank {r}: num_experts {parsed[r][2]}"
                         f"{', another expert_owner' if parsed[r][3] != base[3] else ''}"
                         for r in differ)
        raise errors.make(errors.code_of("MOEFUSE_ERR_INVALID_ARGUMENT"),
                          f"EpGroup.from_process_group: the ranks disagree on the experts' "
                          f"placement (rank 0: num_experts {base[2]}; {said}); every rank "
                          f"passes the same num_experts and expert_owner")
    first = _first(parsed, REFUSED)
    if first is not None:
        _raise(own, first, parsed, "the group")
    return _capi_ep.UniqueId.from_buffer_copy(base[4])
