//! Copies between G1 pages on the device and block images in host memory: the host registration
//! of a G2 pool, the page-copy kernels' batches, and the bounce path through a pinned staging
//! buffer for payloads outside any registration.

use super::*;

/// Host memory registered with the device ([`CudaBackend::register_host`]); unregistered on drop.
///
/// The registration is portable (every context of the process may use it); [`HostRegistration::share`]
/// lets another backend copy through it directly too, until the registration drops.
#[derive(Debug)]
pub struct HostRegistration {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) region: Region,
    /// The region lists of every backend that uses the registration, the registering one first.
    pub(super) users: Mutex<Vec<Arc<Mutex<Vec<Region>>>>>,
}

impl HostRegistration {
    /// Lets `backend` (a backend of the same process, any device context) gather into and scatter
    /// from the registered memory directly.
    pub fn share(&self, backend: &CudaBackend) {
        backend.regions.lock().unwrap_or_else(|e| e.into_inner()).push(self.region);
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        // Backends dropped since (a worker restarted) no longer need the region removed.
        users.retain(|regions| Arc::strong_count(regions) > 1);
        users.push(backend.regions.clone());
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        for regions in self.users.get_mut().unwrap_or_else(|e| e.into_inner()).iter() {
            regions.lock().unwrap_or_else(|e| e.into_inner()).retain(|r| r.host != self.region.host);
        }
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the region was registered by `register_host` and is unregistered exactly once, here;
        // the backend waits for its stream after every synchronous launch that used it, and started
        // copies are finished before their `CudaCopies` is gone (which outlives no G2 pool: the
        // workers finish theirs at every turn's end), so no copy is in flight.
        let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.region.host as *mut std::ffi::c_void) }.result();
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Region {
    pub(super) host: usize,
    pub(super) len: usize,
    pub(super) device: u64,
}

/// A pinned (page-locked, not write-combined) host buffer from `cuMemHostAlloc`.
#[derive(Debug)]
pub(super) struct PinnedBuf {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: the buffer is plain host memory owned by this struct; it is only touched under the
// backend's staging mutex.
unsafe impl Send for PinnedBuf {}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once; the stream was synchronised
        // after its last use.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

#[derive(Debug, Default)]
pub(super) struct Staging {
    pub(super) device: Option<CudaSlice<u8>>,
    pub(super) host: Option<PinnedBuf>,
}

/// Largest bounce-path batch in bytes; bigger batches are moved in several rounds.
pub(super) const STAGING_BYTES: usize = 256 << 20;

/// Pages (thread blocks) a started scatter's launch copies at least: a small batch copies several
/// layers per launch rather than paying a launch for a handful of pages.
pub(super) const SCATTER_LAUNCH_CTAS: usize = 512;

/// One gather/scatter batch uploaded for the page-copy kernels.
#[derive(Debug)]
pub(super) struct PageJobs {
    pub(super) blocks: CudaSlice<u32>,
    pub(super) addrs: CudaSlice<u64>,
    pub(super) n_blocks: usize,
    pub(super) vec16: i32,
}

/// Gathers or scatters started on the load or store stream ([`Backend::kv_gather_start`],
/// [`Backend::kv_scatter_start`]); dropping it waits for them.
#[derive(Debug)]
pub struct CudaCopies {
    /// The start and end events on their stream; `None` when the batch went the synchronous way
    /// (empty, or a payload outside registered memory).
    pub(super) queued: Option<(CudaEvent, CudaEvent)>,
    /// How long a synchronous batch took.
    pub(super) finished: Duration,
    /// The batch's uploaded block ids and addresses, which the copies read (freed on the compute
    /// stream, once the copies are over).
    pub(super) _jobs: Option<PageJobs>,
}

impl CudaCopies {
    /// Runs `copy` (a synchronous gather or scatter) and answers it as copies already over.
    pub(super) fn timed(copy: impl FnOnce() -> Result<(), KernelError>) -> Result<Self, KernelError> {
        let started = Instant::now();
        copy()?;
        Ok(Self { queued: None, finished: started.elapsed(), _jobs: None })
    }
}

impl Drop for CudaCopies {
    fn drop(&mut self) {
        if let Some((_, end)) = &self.queued {
            // Nothing to report an error to: the buffers' owner only needs the copies to be over.
            let _ = end.synchronize();
        }
    }
}

impl CudaBackend {
    /// Registers `len` bytes of host memory at `ptr` (page-locks it and maps it for the device), so
    /// that gathers into and scatters from payloads inside it run as one kernel over PCIe.
    ///
    /// # Safety
    /// The memory must stay mapped and must not be freed while the returned handle lives; the
    /// caller must not hand the backend a payload in it that another thread writes concurrently.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<HostRegistration, KernelError> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller guarantees `ptr..ptr + len` is mapped host memory that outlives the handle.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) }
            .result()
            .map_err(driver_err("cuMemHostRegister"))?;
        let mut device = 0u64;
        // SAFETY: `ptr` was registered just above with DEVICEMAP; `device` is a valid out-pointer.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, ptr.cast(), 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: undoing the registration made above.
            let _ = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
            return Err(driver_err("cuMemHostGetDevicePointer")(e));
        }
        let region = Region { host: ptr as usize, len, device };
        self.regions.lock().unwrap_or_else(|e| e.into_inner()).push(region);
        Ok(HostRegistration { ctx: self.ctx.clone(), region, users: Mutex::new(vec![self.regions.clone()]) })
    }

    /// Device addresses of `payloads` (each `len` bytes) when every one lies in a registered region.
    pub(super) fn mapped_addresses(&self, payloads: impl Iterator<Item = usize>, len: usize) -> Option<Vec<u64>> {
        let regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        payloads
            .map(|p| {
                regions
                    .iter()
                    .find(|r| p >= r.host && p + len <= r.host + r.len)
                    .map(|r| r.device + (p - r.host) as u64)
            })
            .collect()
    }

    /// Uploads a gather/scatter batch's block ids and payload addresses on the compute stream.
    pub(super) fn page_jobs(
        &self,
        kv: &CudaKv,
        blocks: &[u32],
        payload_addrs: &[u64],
    ) -> Result<PageJobs, KernelError> {
        let page_bytes = kv.layout.page_bytes() as u64;
        let vec16 = i32::from(page_bytes.is_multiple_of(16) && payload_addrs.iter().all(|a| a.is_multiple_of(16)));
        Ok(PageJobs {
            blocks: self.stream.clone_htod(blocks).map_err(driver_err("upload"))?,
            addrs: self.stream.clone_htod(payload_addrs).map_err(driver_err("upload"))?,
            n_blocks: blocks.len(),
            vec16,
        })
    }

    /// Queues the copy of pages `pages` (of the `[layer][k|v]` order) of every block of `jobs` on
    /// `stream`: pool → payloads when `gather`, payloads → pool otherwise.
    pub(super) fn launch_pages(
        &self,
        stream: &Arc<CudaStream>,
        gather: bool,
        kv: &CudaKv,
        jobs: &PageJobs,
        pages: Range<usize>,
    ) -> Result<(), KernelError> {
        if jobs.n_blocks == 0 || pages.is_empty() {
            return Ok(());
        }
        let page_bytes = kv.layout.page_bytes() as u64;
        let (first_page, n_pages, n_blocks) = (pages.start as i32, pages.len() as i32, jobs.n_blocks as i32);
        let grid = (jobs.n_blocks * pages.len()) as u32;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let func = if gather { &self.kernels.gather } else { &self.kernels.scatter };
        let mut b = stream.launch_builder(func);
        b.arg(&kv.pages)
            .arg(&first_page)
            .arg(&n_pages)
            .arg(&jobs.blocks)
            .arg(&jobs.addrs)
            .arg(&n_blocks)
            .arg(&page_bytes)
            .arg(&jobs.vec16);
        // SAFETY: kv_{gather,scatter}_pages(const u64*, int, int, const unsigned*, const u64*, int, u64,
        // int): `pages` holds layers × 2 array addresses of num_blocks pages each and `pages` lies
        // inside 0..layers × 2 (the callers pass that or one layer's two), every block id is below
        // num_blocks (checked by the caller), and every payload address is device-accessible memory
        // of layers × 2 × page_bytes bytes (device staging or registered host memory).
        unsafe { b.launch(cfg) }.map_err(driver_err(if gather { "kv_gather_pages" } else { "kv_scatter_pages" }))?;
        Ok(())
    }

    /// Copies every page of `blocks` on the compute stream (queued, not waited for).
    pub(super) fn copy_pages(
        &self,
        gather: bool,
        kv: &CudaKv,
        blocks: &[u32],
        payload_addrs: &[u64],
    ) -> Result<(), KernelError> {
        if blocks.is_empty() {
            return Ok(());
        }
        let jobs = self.page_jobs(kv, blocks, payload_addrs)?;
        self.launch_pages(&self.stream, gather, kv, &jobs, 0..kv.layout.layers * 2)
    }

    /// Starts the copies of a batch on `copy` (the load or store stream), behind the compute
    /// queued so far and the work of the streams in `after`: the batch's block ids and addresses
    /// are uploaded on the compute stream (where pageable uploads already wait; a copy stream never
    /// waits on one), and `queue` launches the copies between the timing events. The uploads live
    /// in the returned [`CudaCopies`] until the copies are over. When anything fails, the copies
    /// already queued are waited for before the error returns, so no copy outlives the caller's
    /// buffers.
    pub(super) fn start_copies(
        &self,
        copy: &Arc<CudaStream>,
        after: &[&Arc<CudaStream>],
        kv: &CudaKv,
        blocks: &[u32],
        payload_addrs: &[u64],
        queue: impl FnOnce(&PageJobs) -> Result<(), KernelError>,
    ) -> Result<CudaCopies, KernelError> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        let jobs = self.page_jobs(kv, blocks, payload_addrs)?;
        let queued = (|| {
            for stream in std::iter::once(&self.stream).chain(after.iter().copied()) {
                let before = stream.record_event(None).map_err(driver_err("cuEventRecord"))?;
                copy.wait(&before).map_err(driver_err("cuStreamWaitEvent"))?;
            }
            let start = copy.record_event(Some(CU_EVENT_DEFAULT)).map_err(driver_err("cuEventRecord"))?;
            queue(&jobs)?;
            copy.record_event(Some(CU_EVENT_DEFAULT)).map_err(driver_err("cuEventRecord")).map(|end| (start, end))
        })();
        match queued {
            Ok(events) => Ok(CudaCopies { queued: Some(events), finished: Duration::ZERO, _jobs: Some(jobs) }),
            Err(e) => {
                let _ = copy.synchronize();
                Err(e)
            }
        }
    }

    /// Checks a batch to start on a copy stream and answers its payloads' device addresses, or
    /// `None` when it goes the synchronous way: empty, or a payload outside registered memory.
    pub(super) fn started_batch(
        &self,
        kv: &CudaKv,
        blocks: &[u32],
        payloads: impl ExactSizeIterator<Item = (usize, usize)> + Clone,
    ) -> Result<Option<Vec<u64>>, KernelError> {
        Self::check_batch(kv, blocks, payloads.clone().map(|(_, len)| len), payloads.len())?;
        if blocks.is_empty() {
            return Ok(None);
        }
        Ok(self.mapped_addresses(payloads.map(|(ptr, _)| ptr), kv.layout.payload_bytes()))
    }

    /// A scatter's target blocks must be distinct (two payloads into one page race).
    pub(super) fn check_distinct(blocks: &[u32]) -> Result<(), KernelError> {
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        match blocks.iter().find(|&&b| !seen.insert(b)) {
            Some(&dup) => Err(LayoutError::DuplicateTarget(dup).into()),
            None => Ok(()),
        }
    }

    pub(super) fn check_batch(
        kv: &CudaKv,
        blocks: &[u32],
        lens: impl Iterator<Item = usize>,
        n: usize,
    ) -> Result<(), KernelError> {
        if blocks.len() != n {
            return Err(LayoutError::BatchMismatch { blocks: blocks.len(), payloads: n }.into());
        }
        let need = kv.layout.payload_bytes();
        for (index, len) in lens.enumerate() {
            if len != need {
                return Err(LayoutError::PayloadLength { index, len, need }.into());
            }
        }
        if let Some(&block) = blocks.iter().find(|&&b| b as usize >= kv.num_blocks) {
            return Err(LayoutError::BlockOutOfRange { block, num_blocks: kv.num_blocks }.into());
        }
        Ok(())
    }

    /// Runs `f` with device and pinned staging buffers of at least `bytes`.
    pub(super) fn with_staging<T>(
        &self,
        bytes: usize,
        f: impl FnOnce(&mut CudaSlice<u8>, &mut PinnedBuf) -> Result<T, KernelError>,
    ) -> Result<T, KernelError> {
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if staging.device.as_ref().is_none_or(|d| d.len() < bytes) {
            staging.device = None;
            // SAFETY: the staging buffer is always written (by a kernel or a copy) before it is read.
            let d = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(|_| KernelError::OutOfMemory { bytes })?;
            staging.device = Some(d);
        }
        if staging.host.as_ref().is_none_or(|h| h.len < bytes) {
            staging.host = None;
            self.ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
            // SAFETY: flags 0 = portable-less, not write-combined pinned memory; the result is checked.
            let ptr = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }.map_err(driver_err("cuMemHostAlloc"))?;
            staging.host = Some(PinnedBuf { ptr: ptr.cast(), len: bytes });
        }
        let Staging { device: Some(d), host: Some(h) } = &mut *staging else { unreachable!("allocated above") };
        f(d, h)
    }
}
