//! G2: the node's host memory tier — one large page-aligned allocation carved into block-image slots.
//!
//! The pool is mapped once (`mmap`, page-aligned, optionally `mlock`ed so it can never be swapped and
//! can be registered with io_uring and, later, with CUDA and RDMA without re-pinning). Slots are
//! handed out by a lock-free free list ([`crossbeam_queue::ArrayQueue`]): taking a slot is one CAS.
//!
//! A slot has two typed states:
//! - [`SlotMut`] — exclusive, writable; a producer (the engine's gather, an NVMe read, a peer fetch)
//!   fills it and then [`SlotMut::freeze`]s it.
//! - [`SlotRef`] — shared, read-only, reference-counted; cloning is one atomic increment, and the slot
//!   returns to the free list when the last reference drops. The tier's own "resident" reference is
//!   one of them, so evicting a block that a reader still holds frees its slot only after the reader is
//!   done.
//!
//! Writers never alias readers: a slot index leaves the free list exactly once per life, so a
//! `SlotMut` is unique, and a `SlotRef` exposes only `&[u8]`.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crossbeam_queue::ArrayQueue;

/// O_DIRECT and registered-buffer alignment: slots are multiples of this.
pub const SLOT_ALIGN: usize = 4096;

/// Rounds `bytes` up to a multiple of [`SLOT_ALIGN`].
pub fn align_up(bytes: usize) -> usize {
    bytes.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}

/// Whether to lock the pool into RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MlockPolicy {
    /// Do not lock.
    Off,
    /// Lock if `RLIMIT_MEMLOCK` (or `CAP_IPC_LOCK`) allows; otherwise warn and go on.
    #[default]
    Try,
    /// Fail pool creation if the pool cannot be locked.
    Require,
}

impl From<dynamo_config::MlockMode> for MlockPolicy {
    fn from(mode: dynamo_config::MlockMode) -> Self {
        match mode {
            dynamo_config::MlockMode::Off => MlockPolicy::Off,
            dynamo_config::MlockMode::Try => MlockPolicy::Try,
            dynamo_config::MlockMode::Require => MlockPolicy::Require,
        }
    }
}

/// How a [`HostPool`] is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostPoolOptions {
    /// Bytes per slot; rounded up to [`SLOT_ALIGN`].
    pub slot_bytes: usize,
    /// Number of slots.
    pub slots: u32,
    /// Locking policy.
    pub mlock: MlockPolicy,
}

impl HostPoolOptions {
    /// As many slots of `slot_bytes` as fit in `capacity` bytes.
    pub fn with_capacity(capacity: u64, slot_bytes: usize, mlock: MlockPolicy) -> Self {
        let slot_bytes = align_up(slot_bytes.max(1));
        let slots = (capacity / slot_bytes as u64).min(u32::MAX as u64 - 1) as u32;
        Self { slot_bytes, slots, mlock }
    }
}

/// Why a pool could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// Zero slots or zero-sized slots.
    #[error("a host pool needs at least one slot of at least one byte (asked for {slots} × {slot_bytes} B)")]
    Empty {
        /// Slots asked for.
        slots: u32,
        /// Slot size asked for.
        slot_bytes: usize,
    },
    /// `mmap` failed.
    #[error("cannot map {bytes} bytes for the G2 pool: {source}")]
    Map {
        /// Bytes asked for.
        bytes: usize,
        /// The OS error.
        source: std::io::Error,
    },
    /// `mlock` failed under [`MlockPolicy::Require`].
    #[error(
        "cannot lock {bytes} bytes of G2 into RAM ({source}); raise `ulimit -l` / LimitMEMLOCK, grant CAP_IPC_LOCK, or set tiers.g2.mlock = \"try\""
    )]
    Lock {
        /// Bytes asked for.
        bytes: usize,
        /// The OS error.
        source: std::io::Error,
    },
}

impl PoolError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PoolError::Empty { .. } => "empty",
            PoolError::Map { .. } => "map",
            PoolError::Lock { .. } => "lock",
        }
    }
}

struct PoolInner {
    base: NonNull<u8>,
    /// The memfd behind a shared pool ([`HostPool::shared`]); `None` for a private mapping.
    fd: Option<std::os::fd::OwnedFd>,
    map_bytes: usize,
    slot_bytes: usize,
    slots: u32,
    locked: bool,
    free: ArrayQueue<u32>,
    refs: Box<[AtomicU32]>,
    allocations: AtomicU64,
    exhausted: AtomicU64,
}

// SAFETY: `base` points to a mapping owned by this struct for its whole life.
// Access to slot bytes is mediated by `SlotMut` (unique, by free-list ownership) and `SlotRef`
// (shared read-only), so sending or sharing the pool across threads cannot create a data race.
unsafe impl Send for PoolInner {}
// SAFETY: see `Send` above; every other field is itself `Sync`.
unsafe impl Sync for PoolInner {}

/// Transparent huge pages' size on x86-64 and arm64 (4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Maps `bytes` read-write (anonymous, or of `fd` at offset 0) starting on a 2 MiB boundary, and
/// asks for transparent huge pages there. A slot is a 2 MiB block and its header: in 4 KiB pages
/// every slot written or read costs 513 TLB misses and page walks, in huge pages two. The hint is
/// only a hint: where THP is off (for shared memory, `shmem_enabled`), the pages stay small.
fn map_huge_aligned(bytes: usize, flags: libc::c_int, fd: libc::c_int) -> std::io::Result<*mut libc::c_void> {
    // Reserve room to slide to a boundary, then put the mapping there and return the rest.
    let reserve = bytes + HUGE_PAGE;
    // SAFETY: an inaccessible anonymous reservation with no address hint; the result is checked.
    let area = unsafe {
        libc::mmap(std::ptr::null_mut(), reserve, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if area == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let lead = (HUGE_PAGE - area as usize % HUGE_PAGE) % HUGE_PAGE;
    let start = area.wrapping_byte_add(lead);
    // SAFETY: `start..start + bytes` lies inside the reservation just made, which nothing else
    // uses, so MAP_FIXED replaces only our own pages; `fd`, when given, is a memfd we own that is
    // exactly `bytes` long. The result is checked.
    let ptr = unsafe { libc::mmap(start, bytes, libc::PROT_READ | libc::PROT_WRITE, flags | libc::MAP_FIXED, fd, 0) };
    if ptr == libc::MAP_FAILED {
        let error = std::io::Error::last_os_error();
        // SAFETY: unmapping the reservation made above, which nothing references.
        unsafe { libc::munmap(area, reserve) };
        return Err(error);
    }
    let tail = reserve - lead - bytes;
    if lead > 0 {
        // SAFETY: the reservation's head, before the mapping just placed, which nothing uses.
        unsafe { libc::munmap(area, lead) };
    }
    if tail > 0 {
        // SAFETY: the reservation's tail, after the mapping just placed, which nothing uses.
        unsafe { libc::munmap(start.wrapping_byte_add(bytes), tail) };
    }
    // A hint; where it fails (THP compiled out) only speed changes.
    // SAFETY: advice on exactly the mapping just placed.
    unsafe { libc::madvise(ptr, bytes, libc::MADV_HUGEPAGE) };
    Ok(ptr)
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        // SAFETY: `base`/`map_bytes` describe exactly the mapping created in `HostPool::new`, and no
        // slot handle outlives the `Arc<PoolInner>` it holds, so nothing references the mapping now.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.map_bytes);
        }
    }
}

impl PoolInner {
    fn slot_ptr(&self, index: u32) -> *mut u8 {
        debug_assert!(index < self.slots);
        // SAFETY: index < slots, so the offset lies inside the mapping of slots × slot_bytes bytes.
        unsafe { self.base.as_ptr().add(index as usize * self.slot_bytes) }
    }

    fn release(&self, index: u32) {
        if self.refs[index as usize].fetch_sub(1, Ordering::AcqRel) == 1 {
            // The free list has room for every slot, and this index is not in it.
            let pushed = self.free.push(index);
            debug_assert!(pushed.is_ok());
        }
    }
}

/// The G2 pool. Cheap to clone (an `Arc`).
#[derive(Clone)]
pub struct HostPool {
    inner: Arc<PoolInner>,
}

impl fmt::Debug for HostPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPool")
            .field("slot_bytes", &self.inner.slot_bytes)
            .field("slots", &self.inner.slots)
            .field("free", &self.inner.free.len())
            .field("locked", &self.inner.locked)
            .finish()
    }
}

impl HostPool {
    /// Maps and (per policy) locks the pool, private to this process.
    pub fn new(options: HostPoolOptions) -> Result<Self, PoolError> {
        Self::build(options, false)
    }

    /// Like [`HostPool::new`], but the pool is a `memfd` mapped shared, so that other processes
    /// (external engines, given [`HostPool::share_fd`]) can map the very same pages. Everything
    /// else — locking, slots, io_uring registration — is as for a private pool.
    pub fn shared(options: HostPoolOptions) -> Result<Self, PoolError> {
        Self::build(options, true)
    }

    fn build(options: HostPoolOptions, shared: bool) -> Result<Self, PoolError> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

        let slot_bytes = align_up(options.slot_bytes);
        if options.slots == 0 || options.slot_bytes == 0 {
            return Err(PoolError::Empty { slots: options.slots, slot_bytes: options.slot_bytes });
        }
        let map_bytes = slot_bytes * options.slots as usize;
        let map_error = |source| PoolError::Map { bytes: map_bytes, source };
        let fd = if shared {
            // SAFETY: the name is a NUL-terminated string literal; the result is checked.
            let raw = unsafe { libc::memfd_create(c"dynamo-node-g2".as_ptr(), libc::MFD_CLOEXEC) };
            if raw < 0 {
                return Err(map_error(std::io::Error::last_os_error()));
            }
            // SAFETY: `raw` is a descriptor just returned to us and owned by nothing else.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // SAFETY: ftruncate on a descriptor we own; the result is checked.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), map_bytes as libc::off_t) } != 0 {
                return Err(map_error(std::io::Error::last_os_error()));
            }
            Some(fd)
        } else {
            None
        };
        let (flags, raw_fd) = match &fd {
            Some(fd) => (libc::MAP_SHARED, fd.as_raw_fd()),
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
        };
        let ptr = map_huge_aligned(map_bytes, flags, raw_fd).map_err(map_error)?;
        let base = NonNull::new(ptr.cast::<u8>()).expect("mmap never returns null on success");
        let mut locked = false;
        if options.mlock != MlockPolicy::Off {
            // SAFETY: the range is exactly the mapping just created.
            let rc = unsafe { libc::mlock(ptr, map_bytes) };
            if rc == 0 {
                locked = true;
            } else {
                let source = std::io::Error::last_os_error();
                if options.mlock == MlockPolicy::Require {
                    // SAFETY: unmapping the mapping created above, which nothing references yet.
                    unsafe { libc::munmap(ptr, map_bytes) };
                    return Err(PoolError::Lock { bytes: map_bytes, source });
                }
                tracing::warn!(
                    bytes = map_bytes,
                    error = %source,
                    "G2 pool is not locked in RAM (mlock failed); it may be swapped and io_uring buffer \
                     registration may fail. Raise `ulimit -l` or grant CAP_IPC_LOCK to lock it."
                );
            }
        }
        let free = ArrayQueue::new(options.slots as usize);
        for i in 0..options.slots {
            free.push(i).expect("queue sized for every slot");
        }
        let refs = (0..options.slots).map(|_| AtomicU32::new(0)).collect();
        Ok(Self {
            inner: Arc::new(PoolInner {
                base,
                fd,
                map_bytes,
                slot_bytes,
                slots: options.slots,
                locked,
                free,
                refs,
                allocations: AtomicU64::new(0),
                exhausted: AtomicU64::new(0),
            }),
        })
    }

    /// Takes a free slot, or `None` when every slot is in use (the caller evicts and retries).
    pub fn try_alloc(&self) -> Option<SlotMut> {
        match self.inner.free.pop() {
            Some(index) => {
                let prev = self.inner.refs[index as usize].swap(1, Ordering::AcqRel);
                debug_assert_eq!(prev, 0, "a free slot had references");
                self.inner.allocations.fetch_add(1, Ordering::Relaxed);
                Some(SlotMut { pool: self.inner.clone(), index })
            }
            None => {
                self.inner.exhausted.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Bytes per slot (a multiple of [`SLOT_ALIGN`]).
    pub fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes
    }

    /// Total slots.
    pub fn slots(&self) -> u32 {
        self.inner.slots
    }

    /// Slots on the free list now.
    pub fn free_slots(&self) -> usize {
        self.inner.free.len()
    }

    /// Whether the pool is locked in RAM.
    pub fn is_locked(&self) -> bool {
        self.inner.locked
    }

    /// Allocation attempts that found the pool exhausted.
    pub fn exhausted_total(&self) -> u64 {
        self.inner.exhausted.load(Ordering::Relaxed)
    }

    /// The whole mapping as `(address, length)`, for registering it with io_uring, CUDA or RDMA.
    pub fn region(&self) -> (*mut u8, usize) {
        (self.inner.base.as_ptr(), self.inner.map_bytes)
    }

    /// The memfd of a [`HostPool::shared`] pool, for handing to another process (`SCM_RIGHTS`);
    /// `None` for a private pool.
    pub fn share_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.inner.fd.as_ref().map(|fd| fd.as_fd())
    }
}

/// An exclusive, writable slot. Dropping it returns the slot to the pool.
pub struct SlotMut {
    pool: Arc<PoolInner>,
    index: u32,
}

impl SlotMut {
    /// The slot's index in its pool.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The slot's bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the slot lies inside the mapping, is `slot_bytes` long, and this handle is its
        // only user (it left the free list into this handle and no `SlotRef` exists yet).
        unsafe { std::slice::from_raw_parts_mut(self.pool.slot_ptr(self.index), self.pool.slot_bytes) }
    }

    /// The slot's bytes, read-only.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `as_mut_slice`; a shared borrow of the unique handle.
        unsafe { std::slice::from_raw_parts(self.pool.slot_ptr(self.index), self.pool.slot_bytes) }
    }

    /// Raw pointer to the slot, for I/O engines that hand it to the kernel. The handle must stay
    /// alive (owned by the in-flight operation) until the kernel is done with the memory.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pool.slot_ptr(self.index)
    }

    /// Turns the slot into a shared, read-only reference (refcount 1).
    pub fn freeze(self) -> SlotRef {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so moving the Arc out transfers its ownership exactly once.
        let pool = unsafe { std::ptr::read(&this.pool) };
        SlotRef { pool, index: this.index }
    }

    /// The pool's base address and this slot's offset in it (for fixed-buffer I/O).
    pub fn pool_offset(&self) -> (usize, usize) {
        (self.pool.base.as_ptr() as usize, self.index as usize * self.pool.slot_bytes)
    }
}

impl Drop for SlotMut {
    fn drop(&mut self) {
        self.pool.release(self.index);
    }
}

impl fmt::Debug for SlotMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotMut").field("index", &self.index).finish()
    }
}

/// A shared, read-only, reference-counted slot.
pub struct SlotRef {
    pool: Arc<PoolInner>,
    index: u32,
}

impl SlotRef {
    /// The slot's index in its pool.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The slot's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the slot lies inside the mapping; while any `SlotRef` exists no `SlotMut` for this
        // index can exist (the index is off the free list until the last reference drops).
        unsafe { std::slice::from_raw_parts(self.pool.slot_ptr(self.index), self.pool.slot_bytes) }
    }

    /// Raw pointer to the slot, for I/O engines (read-only use).
    pub fn as_ptr(&self) -> *const u8 {
        self.pool.slot_ptr(self.index)
    }

    /// References held on this slot right now (including this one).
    pub fn ref_count(&self) -> u32 {
        self.pool.refs[self.index as usize].load(Ordering::Acquire)
    }

    /// Reclaims exclusive access when this is the only reference, for reuse without a round trip
    /// through the free list; otherwise hands the reference back.
    pub fn try_into_mut(self) -> Result<SlotMut, SlotRef> {
        if self.ref_count() == 1 {
            let this = std::mem::ManuallyDrop::new(self);
            // SAFETY: `this` is never dropped, so the Arc is moved out exactly once. With a count of
            // one held by this very handle, no other handle can appear (clones need a handle).
            let pool = unsafe { std::ptr::read(&this.pool) };
            Ok(SlotMut { pool, index: this.index })
        } else {
            Err(self)
        }
    }

    /// The pool's base address and this slot's offset in it (for fixed-buffer I/O).
    pub fn pool_offset(&self) -> (usize, usize) {
        (self.pool.base.as_ptr() as usize, self.index as usize * self.pool.slot_bytes)
    }
}

impl Clone for SlotRef {
    fn clone(&self) -> Self {
        self.pool.refs[self.index as usize].fetch_add(1, Ordering::Relaxed);
        Self { pool: self.pool.clone(), index: self.index }
    }
}

impl Drop for SlotRef {
    fn drop(&mut self) {
        self.pool.release(self.index);
    }
}

impl fmt::Debug for SlotRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotRef").field("index", &self.index).field("refs", &self.ref_count()).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn pools_start_on_a_huge_page_boundary_private_or_shared() {
        for shared in [false, true] {
            let options = HostPoolOptions { slot_bytes: (1 << 20) + 4096, slots: 5, mlock: MlockPolicy::Off };
            let pool = if shared { HostPool::shared(options) } else { HostPool::new(options) }.expect("pool");
            let mut first = pool.try_alloc().expect("a slot");
            let base = first.as_mut_slice().as_ptr() as usize;
            assert_eq!(base % HUGE_PAGE, 0, "shared: {shared}");
            // Every byte of the mapping is usable: the last slot's last byte too.
            let mut slots: Vec<SlotMut> = std::iter::from_fn(|| pool.try_alloc()).collect();
            let last = slots.last_mut().expect("slots");
            *last.as_mut_slice().last_mut().expect("a byte") = 7;
        }
    }

    fn pool(slots: u32) -> HostPool {
        HostPool::new(HostPoolOptions { slot_bytes: 8192, slots, mlock: MlockPolicy::Try }).expect("pool")
    }

    #[test]
    fn slots_are_page_aligned_and_distinct() {
        let p = pool(8);
        let mut seen = HashSet::new();
        let mut held = Vec::new();
        while let Some(mut s) = p.try_alloc() {
            assert_eq!(s.as_mut_ptr() as usize % SLOT_ALIGN, 0);
            assert!(seen.insert(s.index()));
            held.push(s);
        }
        assert_eq!(held.len(), 8);
        assert_eq!(p.exhausted_total(), 1);
        drop(held);
        assert_eq!(p.free_slots(), 8);
    }

    #[test]
    fn slot_returns_only_after_last_reference() {
        let p = pool(1);
        let mut s = p.try_alloc().expect("slot");
        s.as_mut_slice()[..4].copy_from_slice(b"kvkv");
        let a = s.freeze();
        let b = a.clone();
        assert_eq!(a.ref_count(), 2);
        drop(a);
        assert!(p.try_alloc().is_none(), "slot still referenced");
        assert_eq!(&b.as_slice()[..4], b"kvkv");
        drop(b);
        assert!(p.try_alloc().is_some());
    }

    #[test]
    fn try_into_mut_needs_sole_ownership() {
        let p = pool(1);
        let a = p.try_alloc().expect("slot").freeze();
        let b = a.clone();
        let a = a.try_into_mut().expect_err("shared");
        drop(b);
        let m = a.try_into_mut().expect("sole owner");
        assert_eq!(p.free_slots(), 0);
        drop(m);
        assert_eq!(p.free_slots(), 1);
    }

    #[test]
    fn concurrent_alloc_never_hands_out_a_slot_twice() {
        let p = pool(64);
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let p = p.clone();
                s.spawn(move || {
                    for _ in 0..2000 {
                        if let Some(mut slot) = p.try_alloc() {
                            slot.as_mut_slice().fill(t);
                            let r = slot.freeze();
                            assert!(r.as_slice().iter().all(|&b| b == t), "slot shared between threads");
                        }
                    }
                });
            }
        });
        assert_eq!(p.free_slots(), 64);
    }

    #[test]
    fn a_shared_pool_is_the_same_memory_through_its_fd() {
        use std::os::fd::AsRawFd;
        let p =
            HostPool::shared(HostPoolOptions { slot_bytes: 4096, slots: 4, mlock: MlockPolicy::Off }).expect("pool");
        let fd = p.share_fd().expect("a shared pool has an fd");
        let (_, len) = p.region();
        // SAFETY: mapping the pool's own memfd, `len` bytes long, shared; unmapped below.
        let other = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(other, libc::MAP_FAILED);
        let mut slot = p.try_alloc().expect("slot");
        let at = slot.index() as usize * p.slot_bytes();
        slot.as_mut_slice()[..5].copy_from_slice(b"hello");
        // SAFETY: `other` maps `len` bytes and `at + 5 <= len`.
        let seen = unsafe { std::slice::from_raw_parts(other.cast::<u8>().wrapping_add(at), 5) };
        assert_eq!(seen, b"hello", "a second mapping sees the pool's bytes");
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(other, len) };
        assert!(
            HostPool::new(HostPoolOptions { slot_bytes: 4096, slots: 1, mlock: MlockPolicy::Off })
                .unwrap()
                .share_fd()
                .is_none()
        );
    }

    #[test]
    fn empty_pool_is_an_error() {
        let err = HostPool::new(HostPoolOptions { slot_bytes: 4096, slots: 0, mlock: MlockPolicy::Off }).unwrap_err();
        assert_eq!(err.kind(), "empty");
    }
}
