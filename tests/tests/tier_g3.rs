//! G3 store: round trips on every real engine, dedup, capacity, restart recovery, corruption on
//! disk, and injected faults (full disk, I/O errors, corrupt reads, cancellation).

use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::Arc;
use std::time::Duration;

use dynamo_tiering::block::{BlockHash, HEADER_LEN};
use dynamo_tiering::g2::HostPool;
use dynamo_tiering::g3::superblock::{data_offset, file_bytes};
use dynamo_tiering::g3::{EngineChoice, G3Error, G3Options, G3Store, WriteOutcome};
use dynamo_tiering::io::IoEngine;
use dynamo_tiering::io::faulty::{FaultPlan, FaultyEngine};
use dynamo_tiering::io::uring::UringOptions;
use dynamo_tiering::test_utils::{image, payload_byte, pool_for};
use futures::future::join_all;

const PAYLOAD: usize = 64 * 1024 - HEADER_LEN;

fn options(dir: &std::path::Path, files: usize, slots_per_file: u64, engine: EngineChoice) -> G3Options {
    G3Options {
        format_foreign: false,
        paths: (0..files).map(|i| dir.join(format!("g3/store.{i}"))).collect(),
        capacity_per_path: file_bytes(slots_per_file, 64 * 1024),
        slot_bytes: 64 * 1024,
        direct_io: true,
        engine,
    }
}

fn engines() -> Vec<EngineChoice> {
    vec![
        EngineChoice::Uring(UringOptions { queue_depth: 8, threads: 2, register_buffers: true }),
        EngineChoice::Uring(UringOptions { queue_depth: 4, threads: 1, register_buffers: false }),
        EngineChoice::Psync { threads: 4 },
    ]
}

fn h(i: u64) -> BlockHash {
    BlockHash(0xABCD_0000_0000_0000_0000_0000_0000_0000 | i as u128)
}

async fn read_ok(store: &G3Store, pool: &HostPool, hash: BlockHash) -> bool {
    let dst = pool.try_alloc().expect("free slot");
    match store.read(hash, dst).await {
        Ok(slot) => {
            let payload = &slot.as_slice()[HEADER_LEN..HEADER_LEN + PAYLOAD];
            assert!(payload.iter().enumerate().all(|(i, &b)| b == payload_byte(hash, i)), "payload bytes differ");
            true
        }
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_on_every_engine() {
    for engine in engines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = pool_for(PAYLOAD, 96);
        let (store, recovery) = G3Store::open(&options(dir.path(), 2, 32, engine), &pool).expect("open");
        assert_eq!(recovery.blocks.len(), 0);
        assert_eq!(store.capacity_slots(), 64);
        let images: Vec<_> = (0..40).map(|i| image(&pool, h(i), i.checked_sub(1).map(h), PAYLOAD)).collect();
        let outcomes = join_all(images.iter().map(|img| store.write(img.clone()))).await;
        assert!(outcomes.iter().all(|o| matches!(o, Ok(WriteOutcome::Written))), "{engine:?}: {outcomes:?}");
        drop(images);
        assert_eq!(store.len(), 40);
        let reads = join_all((0..40).map(|i| read_ok(&store, &pool, h(i)))).await;
        assert!(reads.iter().all(|&ok| ok), "{engine:?}: a block did not read back");
        assert_eq!(store.stats().reads.load(std::sync::atomic::Ordering::Relaxed), 40);
        assert_eq!(pool.free_slots(), 96, "every G2 slot came back");
    }
}

#[tokio::test]
async fn duplicate_writes_are_skipped_and_full_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 8);
    let (store, _) = G3Store::open(&options(dir.path(), 1, 2, engines()[0]), &pool).expect("open");
    let a = image(&pool, h(1), None, PAYLOAD);
    assert_eq!(store.write(a.clone()).await.expect("write"), WriteOutcome::Written);
    assert_eq!(store.write(a).await.expect("write"), WriteOutcome::AlreadyPresent);
    store.write(image(&pool, h(2), None, PAYLOAD)).await.expect("write");
    let err = store.write(image(&pool, h(3), None, PAYLOAD)).await.expect_err("full");
    assert_eq!(err.kind(), "full");
    assert!(store.remove(h(1)));
    assert!(!store.remove(h(1)));
    store.write(image(&pool, h(3), None, PAYLOAD)).await.expect("a slot was freed");
    assert!(!read_ok(&store, &pool, h(1)).await);
    assert!(read_ok(&store, &pool, h(3)).await);
}

#[tokio::test]
async fn restart_recovers_blocks_and_verifies_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 32);
    let opts = options(dir.path(), 2, 16, engines()[0]);
    {
        let (store, _) = G3Store::open(&opts, &pool).expect("open");
        for i in 0..10 {
            store.write(image(&pool, h(i), i.checked_sub(1).map(h), PAYLOAD)).await.expect("write");
        }
        store.remove(h(9));
    }
    let (store, recovery) = G3Store::open(&opts, &pool).expect("reopen");
    // A removed block whose slot was not reused is still a valid image on disk: recovering it is
    // correct (it is verified on every read); the other nine must all be there.
    let mut found: Vec<_> = recovery.blocks.iter().map(|b| b.hash).collect();
    found.sort();
    assert!((0..9).all(|i| found.contains(&h(i))), "recovered {found:?}");
    assert_eq!(recovery.invalid_slots, 0);
    assert_eq!(recovery.formatted_files, 0);
    let parent = recovery.blocks.iter().find(|b| b.hash == h(5)).expect("block 5").parent;
    assert_eq!(parent, Some(h(4)), "parent links survive a restart");
    for i in 0..9 {
        assert!(read_ok(&store, &pool, h(i)).await, "block {i} after restart");
    }
}

/// Flips one byte of file `path` at `offset`, bypassing the store.
fn flip_byte(path: &std::path::Path, offset: u64) {
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(path).expect("open raw");
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.read_exact(&mut b).expect("read");
    b[0] ^= 0x10;
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.write_all(&b).expect("write");
    f.sync_all().expect("sync");
}

#[tokio::test]
async fn corrupt_blocks_on_disk_are_dropped_never_served() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 16);
    let opts = options(dir.path(), 1, 8, engines()[0]);
    {
        let (store, _) = G3Store::open(&opts, &pool).expect("open");
        for i in 0..4 {
            store.write(image(&pool, h(i), None, PAYLOAD)).await.expect("write");
        }
    }
    // Fresh store, files filled front to back: block i sits in slot i.
    let slot = |i: u64| data_offset(64 * 1024) + i * 64 * 1024;
    flip_byte(&opts.paths[0], slot(1) + HEADER_LEN as u64 + 1000); // payload of block 1
    flip_byte(&opts.paths[0], slot(2) + 20); // header (hash field) of block 2
    let (store, recovery) = G3Store::open(&opts, &pool).expect("reopen");
    assert_eq!(recovery.invalid_slots, 1, "the torn header is found by the scan");
    assert!(!store.contains(h(2)));
    assert_eq!(store.stats().corrupt.load(std::sync::atomic::Ordering::Relaxed), 1, "the scan's find is counted");
    assert!(store.contains(h(1)), "payload damage is found on read, not on scan");
    let failure = store.read(h(1), pool.try_alloc().expect("slot")).await.expect_err("corrupt");
    assert_eq!(failure.error.kind(), "corrupt");
    assert!(failure.buf.is_some(), "the destination slot is handed back");
    assert!(!store.contains(h(1)), "a block that failed verification is dropped");
    assert_eq!(store.stats().corrupt.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert!(read_ok(&store, &pool, h(0)).await && read_ok(&store, &pool, h(3)).await);
}

#[tokio::test]
async fn full_disk_and_io_errors_fail_the_block_not_the_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 16);
    let faulty: Arc<std::sync::OnceLock<Arc<FaultyEngine>>> = Arc::default();
    let slot = faulty.clone();
    let (store, _) = G3Store::open_wrapped(&options(dir.path(), 1, 8, engines()[0]), &pool, move |inner| {
        let engine = Arc::new(FaultyEngine::new(inner, FaultPlan::default()));
        slot.set(engine.clone()).expect("set once");
        engine as Arc<dyn IoEngine>
    })
    .expect("open");
    let faulty = faulty.get().expect("wrapped").clone();
    store.write(image(&pool, h(0), None, PAYLOAD)).await.expect("healthy write");

    faulty.set_plan(FaultPlan { fail_writes: Some(libc::ENOSPC), ..FaultPlan::default() });
    for i in 1..20 {
        let err = store.write(image(&pool, h(i), None, PAYLOAD)).await.expect_err("disk full");
        assert!(matches!(err, G3Error::NoSpace(_)), "{err}");
    }
    assert_eq!(store.len(), 1, "failed writes leave nothing behind");
    assert!(read_ok(&store, &pool, h(0)).await, "reads go on while writes fail");

    faulty.set_plan(FaultPlan::default());
    for i in 1..8 {
        store.write(image(&pool, h(i), None, PAYLOAD)).await.expect("disk healed: no slot was leaked");
    }

    faulty.set_plan(FaultPlan { fail_reads: Some(libc::EIO), ..FaultPlan::default() });
    let failure = store.read(h(3), pool.try_alloc().expect("slot")).await.expect_err("EIO");
    assert_eq!(failure.error.kind(), "io");
    assert!(!store.contains(h(3)));
    drop(failure);

    faulty.set_plan(FaultPlan { corrupt_reads_at: Some(HEADER_LEN + 77), ..FaultPlan::default() });
    let failure = store.read(h(4), pool.try_alloc().expect("slot")).await.expect_err("corrupt");
    assert_eq!(failure.error.kind(), "corrupt");
    drop(failure);
    assert!(faulty.injected_total() >= 21);

    faulty.set_plan(FaultPlan::default());
    assert!(read_ok(&store, &pool, h(5)).await);
    assert_eq!(pool.free_slots(), 16, "no G2 slot leaked through any failure");
}

#[tokio::test]
async fn a_cancelled_read_parks_its_slot_until_the_io_is_done() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 4);
    let (store, _) = G3Store::open_wrapped(&options(dir.path(), 1, 4, engines()[0]), &pool, |inner| {
        Arc::new(FaultyEngine::new(
            inner,
            FaultPlan { read_latency: Duration::from_millis(50), ..FaultPlan::default() },
        ))
    })
    .expect("open");
    store.write(image(&pool, h(0), None, PAYLOAD)).await.expect("write");
    let read = store.read(h(0), pool.try_alloc().expect("slot"));
    assert!(tokio::time::timeout(Duration::from_millis(5), read).await.is_err(), "read must still be in flight");
    // The future is gone; the engine still owns the slot until the kernel completes.
    for _ in 0..200 {
        if pool.free_slots() == 4 && store.in_flight() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(pool.free_slots(), 4);
    assert!(store.contains(h(0)), "a cancelled read leaves the block in place");
    assert!(read_ok(&store, &pool, h(0)).await);
}

#[tokio::test]
async fn removing_a_block_under_a_reader_frees_its_slot_after_the_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 8);
    let (store, _) = G3Store::open_wrapped(&options(dir.path(), 1, 1, engines()[0]), &pool, |inner| {
        Arc::new(FaultyEngine::new(
            inner,
            FaultPlan { read_latency: Duration::from_millis(30), ..FaultPlan::default() },
        ))
    })
    .expect("open");
    store.write(image(&pool, h(0), None, PAYLOAD)).await.expect("write");
    let store = Arc::new(store);
    let reader = {
        let (store, pool) = (store.clone(), pool.clone());
        tokio::spawn(async move { store.read(h(0), pool.try_alloc().expect("slot")).await.is_ok() })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(store.remove(h(0)));
    let err = store.write(image(&pool, h(1), None, PAYLOAD)).await.expect_err("the only slot is still being read");
    assert_eq!(err.kind(), "full");
    assert!(reader.await.expect("join"), "the in-flight read still sees its block");
    store.write(image(&pool, h(1), None, PAYLOAD)).await.expect("slot freed after the read");
}

#[tokio::test]
async fn another_slot_size_reformats_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 8);
    let mut opts = options(dir.path(), 1, 4, engines()[0]);
    {
        let (store, _) = G3Store::open(&opts, &pool).expect("open");
        store.write(image(&pool, h(0), None, PAYLOAD)).await.expect("write");
    }
    opts.slot_bytes = 32 * 1024;
    let (store, recovery) = G3Store::open(&opts, &pool).expect("reopen");
    assert_eq!(recovery.formatted_files, 1);
    assert!(recovery.blocks.is_empty());
    assert!(store.is_empty());
    // The file keeps its size: 4 slots of 64 KiB after a 64 KiB head now hold 32 KiB slots after a
    // 32 KiB head.
    assert_eq!(store.capacity_slots(), (file_bytes(4, 64 * 1024) - data_offset(32 * 1024)) / (32 * 1024));
}

/// A path that holds something other than a G3 store is refused and left as it was, unless
/// formatting it was asked for; an all-zero file (a crashed format, a fresh `fallocate`) is not
/// foreign.
#[tokio::test]
async fn a_foreign_path_is_refused_unless_formatting_is_asked_for() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 8);
    let mut opts = options(dir.path(), 1, 4, engines()[0]);
    std::fs::create_dir_all(opts.paths[0].parent().unwrap()).unwrap();
    let text = b"#!/bin/sh\necho important\n".repeat(300);
    std::fs::write(&opts.paths[0], &text).unwrap();
    let err = G3Store::open(&opts, &pool).map(|_| ()).expect_err("foreign data");
    assert_eq!(err.kind(), "foreign");
    assert!(err.to_string().contains("format_foreign"), "{err}");
    assert_eq!(std::fs::read(&opts.paths[0]).unwrap(), text, "untouched");

    opts.format_foreign = true;
    let (store, recovery) = G3Store::open(&opts, &pool).expect("formatted when asked");
    assert_eq!((recovery.formatted_files, store.capacity_slots()), (1, 4));
    drop(store);

    opts.format_foreign = false;
    std::fs::write(&opts.paths[0], vec![0u8; 1 << 20]).unwrap();
    G3Store::open(&opts, &pool).expect("zeros are not foreign data");
    G3Store::open(&opts, &pool).expect("and a G3 store is ours");
}

/// Data that does not start in the first 4 KiB is foreign too: a file of zeros with data after
/// 4 KiB, a btrfs superblock at 64 KiB (named in the error), a ZFS label at the end, a sparse
/// file with one data extent in its middle. Each is refused and left as it was.
#[tokio::test]
async fn foreign_data_past_the_first_4_kib_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 8);
    let opts = options(dir.path(), 1, 4, engines()[0]);
    let path = opts.paths[0].clone();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let with = |len: usize, at: usize, bytes: &[u8]| {
        let mut v = vec![0u8; len];
        v[at..at + bytes.len()].copy_from_slice(bytes);
        v
    };
    let cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        ("data after 4 KiB of zeros", with(64 << 10, 4096, b"important data"), None),
        ("btrfs", with(2 << 20, 0x10040, b"_BHRfS_M"), Some("btrfs")),
        ("a ZFS back label", with(4 << 20, (4 << 20) - (300 << 10), &[0xde, 0xad, 0xbe, 0xef]), None),
    ];
    for (what, bytes, named) in cases {
        std::fs::write(&path, &bytes).unwrap();
        let err = G3Store::open(&opts, &pool).map(|_| ()).expect_err(what);
        assert_eq!(err.kind(), "foreign", "{what}: {err}");
        if let Some(name) = named {
            assert!(err.to_string().contains(name), "{what}: {err}");
        }
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "{what}: untouched");
    }

    // A sparse file of 64 MiB with 4 KiB of data at 20 MiB: found through its data extents.
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(64 << 20).unwrap();
    std::os::unix::fs::FileExt::write_at(&file, &[0x5a; 4096], 20 << 20).unwrap();
    drop(file);
    let err = G3Store::open(&opts, &pool).map(|_| ()).expect_err("an extent in the middle");
    assert_eq!(err.kind(), "foreign", "{err}");
}

/// An open that fails part-way removes what it created: files and directories that were not
/// there before, but never a file that was.
#[tokio::test]
async fn a_failed_open_leaves_the_disk_as_it_found_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool_for(PAYLOAD, 8);
    let mut opts = options(dir.path(), 1, 4, engines()[0]);
    let fresh = dir.path().join("new/dirs/store.0");
    let foreign = dir.path().join("foreign.bin");
    std::fs::write(&foreign, b"not a store").unwrap();
    opts.paths = vec![fresh.clone(), foreign.clone()];
    let err = G3Store::open(&opts, &pool).map(|_| ()).expect_err("the second path is foreign");
    assert_eq!(err.kind(), "foreign");
    assert!(!fresh.exists() && !dir.path().join("new").exists(), "the first file and its directories are gone");
    assert_eq!(std::fs::read(&foreign).unwrap(), b"not a store");

    // More than the file system has: refused before anything is written, naming both sizes.
    let free = dynamo_tiering::g3::free_bytes(dir.path()).expect("statvfs");
    opts.paths = vec![fresh.clone()];
    opts.capacity_per_path = free + (1 << 40);
    let err = G3Store::open(&opts, &pool).map(|_| ()).expect_err("too big");
    assert_eq!(err.kind(), "no_room");
    assert!(err.to_string().contains("free"), "{err}");
    assert!(!fresh.exists() && !dir.path().join("new").exists());
    let after = dynamo_tiering::g3::free_bytes(dir.path()).expect("statvfs");
    assert!(after + (64 << 20) >= free, "free space was {free}, is {after}");
}
