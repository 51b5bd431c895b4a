"""Peer-mapped device buffers with cuda-python (``cuda.bindings.driver``): one allocation per rank, mapped by all.

Each rank creates ``nbytes`` of device memory with ``cuMemCreate`` (exportable), exports it, hands the handle to
every other rank, imports theirs, and maps all N allocations into its own address space with
``cuMemAddressReserve`` / ``cuMemMap`` / ``cuMemSetAccess`` (read-write for its own device). A kernel on rank r
can then load and store rank j's buffer at ``ptrs[j]``: within a host over NVLink (P2P), across hosts of one
NVLink domain (GB200 NVL72) through the fabric handle and IMEX.

Handle types:
  ``posix_fd`` (default, one host)  ``cuMemExportToShareableHandle`` gives a file descriptor. A descriptor is only
      meaningful inside its process, so it is duplicated into each peer process:
        ``pidfd``       the peer calls ``pidfd_open(pid)`` + ``pidfd_getfd`` (Linux >= 5.6, syscall 438); needs
                        ptrace rights over the exporter (root, or same user with Yama ptrace_scope 0). Chosen
                        first: no sockets, no extra thread.
        ``scm_rights``  the exporter sends the descriptor over a Unix socket (abstract namespace) with
                        ``SCM_RIGHTS``; works for any user. Used when pidfd_getfd is refused on any rank.
      Only (pid, fd) pairs / socket names travel over ``torch.distributed.all_gather_object``.
  ``fabric`` (multi-node NVLink, GB200 NVL72)  the export is a 64-byte ``CUmemFabricHandle`` that is valid in any
      process of the NVLink domain that shares the exporter's IMEX channel; its bytes travel directly over
      ``all_gather_object``. Requires the IMEX daemon and a channel (``/dev/nvidia-caps-imex-channels``) and the
      device attribute ``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED``; written, NOT tested here (2xH200 has
      no IMEX). ``PeerBuffer`` refuses it unless ``RACKBED_ALLOW_FABRIC=1`` is set, so nothing takes it by
      accident.

Teardown (``close()``, also on ``with`` exit and garbage collection): unmap every mapping, free the address
ranges, release the handles, close descriptors. A peer's memory stays alive while any importer maps it; each
rank must still stop using the buffers (kernels done) before closing: ``close()`` synchronizes the device and,
when ``barrier=True``, the group first.

No NVLink multicast object is created anywhere here (multicast stays off on shared hosts).
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import uuid
from typing import Any

_SYS_pidfd_getfd = 438


class PeerAccessError(RuntimeError):
    """Raised when this rank cannot map a peer's memory (no P2P/NVLink path, no fabric access)."""


def _drv():
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise PeerAccessError("peer memory needs cuda-python (pip install cuda-bindings)") from exc
    return driver


def check(result: tuple | Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple ``(CUresult, *values)``; raise on an error with the call's name."""
    drv = _drv()
    if not isinstance(result, tuple):
        result = (result,)
    err, rest = result[0], result[1:]
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _pidfd_getfd(pid: int, fd: int) -> int:
    """Duplicate descriptor ``fd`` of process ``pid`` into this process (pidfd_open + pidfd_getfd)."""
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        new = libc.syscall(_SYS_pidfd_getfd, pidfd, fd, 0)
        if new < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid={pid}, fd={fd}): {os.strerror(err)}")
        return new
    finally:
        os.close(pidfd)


class _FdServer:
    """Serves one descriptor to ``n_clients`` connections on an abstract Unix socket (SCM_RIGHTS)."""

    def __init__(self, name: str, fd: int, n_clients: int):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + name)
        self.sock.listen(max(1, n_clients))
        self.fd, self.n = fd, n_clients
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            for _ in range(self.n):
                conn, _ = self.sock.accept()
                with conn:
                    socket.send_fds(conn, [b"fd"], [self.fd])
        except BaseException as exc:  # reported by join()
            self.error = exc

    def join(self, timeout_s: float = 60.0):
        self.thread.join(timeout_s)
        self.sock.close()
        if self.error:
            raise self.error


def _recv_fd(name: str) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect("\0" + name)
        _, fds, _, _ = socket.recv_fds(s, 16, 1)
        if not fds:
            raise OSError(f"no descriptor received from {name}")
        return fds[0]


def _device_uuid(drv, dev) -> str:
    u = check(drv.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    return bytes(u.bytes).hex()


class PeerBuffer:
    """``nbytes`` of device memory on each rank of ``group``, mapped read-write on every rank.

    Attributes: ``rank``, ``world_size``, ``nbytes`` (rounded up to the allocation granularity), ``ptrs``
    (device addresses of every rank's buffer as seen from this process, in global rank order of the group),
    ``local_ptr`` (= ``ptrs[rank]``), ``exchange`` (the descriptor exchange that was used).
    The memory starts zeroed on every rank (zeroed before the closing barrier of the constructor).
    """

    def __init__(self, group, nbytes: int, *, device: int | None = None, handle: str = "posix_fd",
                 exchange: str = "auto"):
        import torch
        import torch.distributed as dist

        if nbytes <= 0:
            raise ValueError(f"PeerBuffer: nbytes={nbytes} must be > 0")
        if handle not in ("posix_fd", "fabric"):
            raise ValueError(f"PeerBuffer: handle={handle!r} must be 'posix_fd' or 'fabric'")
        if exchange not in ("auto", "pidfd", "scm_rights"):
            raise ValueError(f"PeerBuffer: exchange={exchange!r} must be 'auto', 'pidfd' or 'scm_rights'")
        if handle == "fabric" and os.environ.get("RACKBED_ALLOW_FABRIC") != "1":
            raise PeerAccessError("PeerBuffer: handle='fabric' is untested here; set RACKBED_ALLOW_FABRIC=1 "
                                  "on an NVLink-domain system with IMEX channels to use it")
        drv = _drv()
        self._drv = drv
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._handles: list = []
        self._maps: list[tuple[int, int]] = []
        self._reserved: int | None = None
        self._fds: list[int] = []
        self._closed = False

        dev_index = torch.cuda.current_device() if device is None else device
        torch.cuda.set_device(dev_index)
        torch.cuda.init()
        check(drv.cuInit(0), "cuInit")
        self._dev = check(drv.cuDeviceGet(dev_index), "cuDeviceGet")
        ctx = check(drv.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._ctx_dev = self._dev

        htype = (drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if handle == "posix_fd"
                 else drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
        if handle == "fabric":
            ok = check(drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, self._dev),
                "cuDeviceGetAttribute")
            if not ok:
                raise PeerAccessError(f"PeerBuffer: device {dev_index} does not support fabric handles (no IMEX)")

        # 1. who can reach whom: compare device UUIDs with the devices visible here
        my_uuid = _device_uuid(drv, self._dev)
        uuids = [None] * self.world_size
        dist.all_gather_object(uuids, my_uuid, group=group)
        if handle == "posix_fd":
            self._check_peer_access(uuids)

        # 2. allocate and export
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(dev_index)
        prop.requestedHandleTypes = htype
        gran = check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity")
        self.nbytes = -(-int(nbytes) // gran) * gran
        mine = check(drv.cuMemCreate(self.nbytes, prop, 0), "cuMemCreate")
        self._handles.append(mine)
        exported = check(drv.cuMemExportToShareableHandle(mine, htype, 0), "cuMemExportToShareableHandle")

        # 3. exchange and import
        if handle == "fabric":
            blobs = [None] * self.world_size
            dist.all_gather_object(blobs, bytes(exported.data), group=group)
            imported = {}
            for j, blob in enumerate(blobs):
                if j == self.rank:
                    continue
                fh = drv.CUmemFabricHandle()
                fh.data = blob
                try:
                    imported[j] = check(drv.cuMemImportFromShareableHandle(fh, htype), "cuMemImportFromShareableHandle")
                except RuntimeError as exc:
                    raise PeerAccessError(f"PeerBuffer: rank {self.rank} cannot import rank {j}'s fabric handle "
                                          f"(same IMEX channel?): {exc}") from exc
            self.exchange = "fabric"
        else:
            my_fd = int(exported)
            self._fds.append(my_fd)
            peer_fds, self.exchange = self._exchange_fds(my_fd, exchange)
            self._fds.extend(peer_fds.values())
            imported = {j: check(drv.cuMemImportFromShareableHandle(fd, htype), "cuMemImportFromShareableHandle")
                        for j, fd in peer_fds.items()}
        for j in sorted(imported):
            self._handles.append(imported[j])

        # 4. map all N allocations side by side in one reserved range
        self._reserved = check(drv.cuMemAddressReserve(self.nbytes * self.world_size, gran, 0, 0),
                               "cuMemAddressReserve")
        base = int(self._reserved)
        self.ptrs = []
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = int(dev_index)
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for j in range(self.world_size):
            h = mine if j == self.rank else imported[j]
            va = base + j * self.nbytes
            check(drv.cuMemMap(va, self.nbytes, 0, h, 0), "cuMemMap")
            self._maps.append((va, self.nbytes))
            try:
                check(drv.cuMemSetAccess(va, self.nbytes, [access], 1), "cuMemSetAccess")
            except RuntimeError as exc:
                raise PeerAccessError(f"PeerBuffer: rank {self.rank} (GPU {uuids[self.rank][:8]}) cannot access "
                                      f"rank {j}'s memory: {exc}") from exc
            self.ptrs.append(va)
        self.local_ptr = self.ptrs[self.rank]
        check(drv.cuMemsetD8(self.local_ptr, 0, self.nbytes), "cuMemsetD8")
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        dist.barrier(group=group)

    def _check_peer_access(self, uuids: list[str]) -> None:
        """Fail early, with the reason, when a peer GPU is visible here but P2P to it is impossible."""
        drv = self._drv
        n_dev = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        by_uuid = {}
        for i in range(n_dev):
            d = check(drv.cuDeviceGet(i), "cuDeviceGet")
            by_uuid[_device_uuid(drv, d)] = d
        for j, u in enumerate(uuids):
            if j == self.rank or u not in by_uuid:
                continue  # not visible here (CUDA_VISIBLE_DEVICES): cuMemSetAccess will tell
            if u == uuids[self.rank]:
                raise PeerAccessError(f"PeerBuffer: ranks {self.rank} and {j} use the same GPU; one GPU per rank")
            ok = check(drv.cuDeviceCanAccessPeer(self._dev, by_uuid[u]), "cuDeviceCanAccessPeer")
            if not ok:
                raise PeerAccessError(f"PeerBuffer: GPU of rank {self.rank} cannot access the GPU of rank {j} "
                                      "(cuDeviceCanAccessPeer = 0: no NVLink/PCIe P2P path); use the torch "
                                      "fallback (PeerAllReduce(backend='torch'))")

    def _exchange_fds(self, my_fd: int, exchange: str) -> tuple[dict[int, int], str]:
        import torch.distributed as dist

        g = self._group
        peers = [j for j in range(self.world_size) if j != self.rank]
        if exchange in ("auto", "pidfd") and hasattr(os, "pidfd_open"):
            infos = [None] * self.world_size
            dist.all_gather_object(infos, (os.getpid(), my_fd), group=g)
            got, err = {}, None
            try:
                for j in peers:
                    got[j] = _pidfd_getfd(*infos[j])
            except OSError as exc:
                err = str(exc)
            errs = [None] * self.world_size
            dist.all_gather_object(errs, err, group=g)  # every rank learns whether all succeeded
            if not any(errs):
                return got, "pidfd"
            for fd in got.values():
                os.close(fd)
            if exchange == "pidfd":
                raise PeerAccessError(f"PeerBuffer: pidfd_getfd refused: {[e for e in errs if e][0]}")
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0, group=g)
        server = _FdServer(f"rackbed-peer-{token[0]}-{self.rank}", my_fd, len(peers))
        dist.barrier(group=g)  # every server listens before anyone connects
        got = {j: _recv_fd(f"rackbed-peer-{token[0]}-{j}") for j in peers}
        server.join()
        dist.barrier(group=g)
        return got, "scm_rights"

    def close(self, barrier: bool = True) -> None:
        """Unmap and release everything (idempotent). With ``barrier``, wait for all ranks first."""
        if self._closed:
            return
        self._closed = True
        drv = self._drv
        try:
            if barrier:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.barrier(group=self._group)
            drv.cuCtxSynchronize()
        finally:
            for va, size in self._maps:
                drv.cuMemUnmap(va, size)
            if self._reserved is not None:
                drv.cuMemAddressFree(self._reserved, self.nbytes * self.world_size)
            for h in self._handles:
                drv.cuMemRelease(h)
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._maps, self._handles, self._fds, self._reserved = [], [], [], None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(barrier=exc[0] is None)

    def __del__(self):
        try:
            self.close(barrier=False)
        except Exception:
            pass
