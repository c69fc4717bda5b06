//! The copy paths' bandwidth rows of `gpu_check`: each of the node's KV copies against a plain
//! pinned copy of the same bytes on the same device, timed as the median of several runs.

use super::*;
use crate::cuda::driver_err;

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median milliseconds of `f` over `reps` runs (after one warm-up), timed with CUDA events on the
/// backend's stream.
pub(super) fn time_ms(
    cuda: &CudaBackend,
    reps: usize,
    mut f: impl FnMut() -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    use cudarc::driver::sys::CUevent_flags;
    f()?;
    cuda.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = cuda.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver_err("cuEventCreate"))?;
        let end = cuda.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver_err("cuEventCreate"))?;
        start.record(&cuda.stream).map_err(driver_err("cuEventRecord"))?;
        f()?;
        end.record(&cuda.stream).map_err(driver_err("cuEventRecord"))?;
        end.synchronize().map_err(driver_err("cuEventSynchronize"))?;
        times.push(start.elapsed_ms(&end).map_err(driver_err("cuEventElapsedTime"))? as f64);
    }
    Ok(median(times))
}

pub(super) fn gb_s(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

/// The median time of one plain copy of `bytes` from registered (pinned, not write-combined) host
/// memory to the device, over `reps` runs: the host link's limit for loading that much KV.
pub fn pinned_copy_time(cuda: &CudaBackend, bytes: usize, reps: usize) -> Result<std::time::Duration, KernelError> {
    let bytes = bytes.max(1);
    let mut host = HostMapping::new(bytes)?;
    host.bytes_mut().fill(1);
    // SAFETY: `host` outlives `reg` (dropped at the end of this function, before `host`).
    let reg = unsafe { cuda.register_host(host.ptr, host.len) }?;
    let dev: CudaSlice<u8> = cuda.stream.alloc_zeros(bytes).map_err(|_| KernelError::OutOfMemory { bytes })?;
    let (dptr, _g) = dev.device_ptr(&cuda.stream);
    let ms = htod_ms(cuda, &host, dptr, bytes, reps)?;
    drop(reg);
    Ok(std::time::Duration::from_secs_f64(ms / 1e3))
}

/// The median time of a plain copy of the first `bytes` of `host` (registered with the device)
/// to the device buffer at `dptr` (at least `bytes` long), in milliseconds.
pub(super) fn htod_ms(
    cuda: &CudaBackend,
    host: &HostMapping,
    dptr: cudarc::driver::sys::CUdeviceptr,
    bytes: usize,
    reps: usize,
) -> Result<f64, KernelError> {
    time_ms(cuda, reps, || {
        let src = &host.bytes()[..bytes];
        // SAFETY: `host` is registered (pinned) and `src` is its first `bytes`; the device buffer
        // holds `bytes`; the timer waits for the copy before the next one.
        unsafe { cudarc::driver::result::memcpy_htod_async(dptr, src, cuda.stream.cu_stream()) }
            .map_err(driver_err("cuMemcpyHtoDAsync"))
    })
}

/// Gather/scatter against plain copies of the same bytes: on the device (G1 pages ↔ contiguous
/// device buffer vs `cuMemcpyDtoD`), and G1 ↔ G2 (registered host payloads vs one pinned
/// `cuMemcpy`), plus the bounce path for unregistered host buffers (wall clock).
pub(super) fn bandwidth_checks(
    cuda: &CudaBackend,
    opts: &GpuCheckOptions<'_>,
    rows: &mut Vec<BandwidthRow>,
) -> Result<(), KernelError> {
    use cudarc::driver::result as drv;
    // llama-8b geometry: 64 KiB pages, 4 MiB block images.
    let layout = PagedLayout { layers: 32, block_tokens: 32, kv_heads: 8, head_dim: 128, elem_bytes: 2 };
    let payload = layout.payload_bytes();
    let n = (opts.bandwidth_bytes / payload).max(1);
    let bytes = n * payload;
    let kv = cuda.kv_pool(layout, 2 * n)?;
    let blocks: Vec<u32> = (0..n as u32).map(|i| 2 * i + 1).collect();
    let reps = opts.repetitions;
    let err = driver_err;

    // On the device.
    let mut dst: CudaSlice<u8> = cuda.stream.alloc_zeros(bytes).map_err(|_| KernelError::OutOfMemory { bytes })?;
    let src: CudaSlice<u8> = cuda.stream.alloc_zeros(bytes).map_err(|_| KernelError::OutOfMemory { bytes })?;
    let d2d = {
        let (s, _a) = src.device_ptr(&cuda.stream);
        let (d, _b) = dst.device_ptr_mut(&cuda.stream);
        time_ms(cuda, reps, || {
            // SAFETY: both device buffers hold `bytes`.
            unsafe { drv::memcpy_dtod_async(d, s, bytes, cuda.stream.cu_stream()) }.map_err(err("cuMemcpyDtoDAsync"))
        })?
    };
    let dst_base = dst.device_ptr(&cuda.stream).0;
    let addrs: Vec<u64> = (0..n).map(|i| dst_base + (i * payload) as u64).collect();
    let gather = time_ms(cuda, reps, || cuda.copy_pages(true, &kv, &blocks, &addrs))?;
    let mut kv_mut = kv;
    let scatter = time_ms(cuda, reps, || cuda.copy_pages(false, &kv_mut, &blocks, &addrs))?;
    let dev_base = "cuMemcpyDtoD, same bytes";
    rows.push(BandwidthRow {
        path: "gather G1 -> device buffer".into(),
        bytes,
        gb_s: gb_s(bytes, gather),
        baseline: dev_base.into(),
        baseline_gb_s: gb_s(bytes, d2d),
    });
    rows.push(BandwidthRow {
        path: "scatter device buffer -> G1".into(),
        bytes,
        gb_s: gb_s(bytes, scatter),
        baseline: dev_base.into(),
        baseline_gb_s: gb_s(bytes, d2d),
    });
    drop((dst, src));

    // G1 <-> G2: registered host memory (as the G2 pool registers its mapping).
    let mut host = HostMapping::new(bytes)?;
    host.bytes_mut().fill(1);
    // SAFETY: `host` outlives `reg` (dropped below, before `host`).
    let reg = unsafe { cuda.register_host(host.ptr, host.len) }?;
    let dev: CudaSlice<u8> = cuda.stream.alloc_zeros(bytes).map_err(|_| KernelError::OutOfMemory { bytes })?;
    let (dptr, _g) = dev.device_ptr(&cuda.stream);
    let d2h = time_ms(cuda, reps, || {
        // SAFETY: `host` is registered (pinned) and holds `bytes`; the device buffer holds `bytes`.
        let dst = unsafe { std::slice::from_raw_parts_mut(host.ptr, bytes) };
        // SAFETY: see above; completion is awaited by the timer before the next use.
        unsafe { drv::memcpy_dtoh_async(dst, dptr, cuda.stream.cu_stream()) }.map_err(err("cuMemcpyDtoHAsync"))
    })?;
    let h2d = htod_ms(cuda, &host, dptr, bytes, reps)?;
    let g2_gather = {
        let mut times = Vec::new();
        for _ in 0..=reps {
            let t = Instant::now();
            let mut outs: Vec<&mut [u8]> = host.bytes_mut().chunks_exact_mut(payload).collect();
            cuda.kv_gather(&kv_mut, &blocks, &mut outs)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        median(times[1..].to_vec())
    };
    let g2_scatter = {
        let mut times = Vec::new();
        for _ in 0..=reps {
            let t = Instant::now();
            let ins: Vec<&[u8]> = host.bytes().chunks_exact(payload).collect();
            cuda.kv_scatter(&mut kv_mut, &blocks, &ins)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        median(times[1..].to_vec())
    };
    let g2_scatter_started = {
        let mut times = Vec::new();
        for _ in 0..=reps {
            let ins: Vec<&[u8]> = host.bytes().chunks_exact(payload).collect();
            // SAFETY: `host` is not written before the copies are waited for, in this iteration.
            let copies = unsafe { cuda.kv_scatter_start(&mut kv_mut, &blocks, &ins) }?;
            times.push(cuda.copies_wait(copies)?.as_secs_f64() * 1e3);
        }
        median(times[1..].to_vec())
    };
    drop(reg);
    rows.push(BandwidthRow {
        path: "kv_gather G1 -> G2 (registered, 1 kernel)".into(),
        bytes,
        gb_s: gb_s(bytes, g2_gather),
        baseline: "cuMemcpyDtoH pinned, same bytes".into(),
        baseline_gb_s: gb_s(bytes, d2h),
    });
    rows.push(BandwidthRow {
        path: "kv_scatter G2 -> G1 (registered, 1 kernel)".into(),
        bytes,
        gb_s: gb_s(bytes, g2_scatter),
        baseline: "cuMemcpyHtoD pinned, same bytes".into(),
        baseline_gb_s: gb_s(bytes, h2d),
    });
    rows.push(BandwidthRow {
        path: "kv_scatter_start G2 -> G1 (load stream, by layer)".into(),
        bytes,
        gb_s: gb_s(bytes, g2_scatter_started),
        baseline: "cuMemcpyHtoD pinned, same bytes".into(),
        baseline_gb_s: gb_s(bytes, h2d),
    });

    // Bounce path: ordinary (unregistered) host buffers.
    let mut plain = vec![vec![0u8; payload]; n];
    let mut times = Vec::new();
    for _ in 0..=reps {
        let t = Instant::now();
        let mut outs: Vec<&mut [u8]> = plain.iter_mut().map(|p| p.as_mut_slice()).collect();
        cuda.kv_gather(&kv_mut, &blocks, &mut outs)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    rows.push(BandwidthRow {
        path: "kv_gather G1 -> pageable (bounce)".into(),
        bytes,
        gb_s: gb_s(bytes, median(times[1..].to_vec())),
        baseline: "cuMemcpyDtoH pinned, same bytes".into(),
        baseline_gb_s: gb_s(bytes, d2h),
    });
    Ok(())
}
