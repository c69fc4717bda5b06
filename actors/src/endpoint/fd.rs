//! Handing the shared G2 region's file descriptor to an engine: `sendmsg` with `SCM_RIGHTS`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;

/// Sends `frame` on `stream` with `fd` attached (to its first byte), then the rest of the frame.
pub(super) async fn send_with_fd(stream: &mut UnixStream, frame: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let raw = stream.as_raw_fd();
    let sent = stream.async_io(Interest::WRITABLE, || sendmsg_with_fd(raw, frame, fd.as_raw_fd())).await?;
    stream.write_all(&frame[sent..]).await
}

/// One `sendmsg` of (a prefix of) `bytes` carrying `fd` as `SCM_RIGHTS`; returns the bytes sent.
fn sendmsg_with_fd(socket: RawFd, bytes: &[u8], fd: RawFd) -> io::Result<usize> {
    // Room for one descriptor's control message, aligned as cmsghdr wants it.
    #[repr(C)]
    union Control {
        _align: libc::cmsghdr,
        bytes: [u8; 64],
    }
    let mut control = Control { bytes: [0; 64] };
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;
    debug_assert!(space <= 64);
    // SAFETY: an all-zero msghdr is a valid empty message; the fields set below point to `iov`
    // and `control`, which outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: taking the address of the union's byte view; it is `space` ≤ 64 bytes long.
    msg.msg_control = unsafe { control.bytes.as_mut_ptr() }.cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` has a control buffer of `space` bytes, enough for one cmsghdr carrying one
    // descriptor, so CMSG_FIRSTHDR is non-null and CMSG_DATA points inside the buffer.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
    }
    // SAFETY: `socket` is the stream's open descriptor and `msg` is fully initialised above;
    // MSG_NOSIGNAL turns a closed peer into EPIPE instead of a signal.
    let sent = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if sent < 0 { Err(io::Error::last_os_error()) } else { Ok(sent as usize) }
}

/// Receives up to `buf.len()` bytes and at most one descriptor (a client's side, for tests).
pub fn recvmsg_with_fd(socket: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<std::os::fd::OwnedFd>)> {
    use std::os::fd::FromRawFd;
    #[repr(C)]
    union Control {
        _align: libc::cmsghdr,
        bytes: [u8; 64],
    }
    let mut control = Control { bytes: [0; 64] };
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: the union's byte view, 64 bytes long.
    msg.msg_control = unsafe { control.bytes.as_mut_ptr() }.cast();
    msg.msg_controllen = 64;
    // SAFETY: `socket` is an open descriptor and `msg` describes valid buffers; MSG_CMSG_CLOEXEC
    // keeps a received descriptor from leaking into children.
    let got = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fd = None;
    // SAFETY: walking the control messages the kernel wrote into `control`, within
    // `msg_controllen`; an SCM_RIGHTS message carries at least one descriptor we now own.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
                fd = Some(std::os::fd::OwnedFd::from_raw_fd(raw));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((got as usize, fd))
}
