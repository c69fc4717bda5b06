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

/// A control message carrying one descriptor, laid out as `CMSG_SPACE(sizeof(int))` is: the
/// header, then the descriptor at `CMSG_DATA` (the header's size, already aligned on Linux).
#[repr(C)]
struct OneFd {
    header: libc::cmsghdr,
    fd: RawFd,
}

const _: () = assert!(std::mem::offset_of!(OneFd, fd) == size_of::<libc::cmsghdr>());
const _: () = assert!(size_of::<libc::cmsghdr>().is_multiple_of(size_of::<usize>()));

/// One `sendmsg` of (a prefix of) `bytes` carrying `fd` as `SCM_RIGHTS`; returns the bytes sent.
fn sendmsg_with_fd(socket: RawFd, bytes: &[u8], fd: RawFd) -> io::Result<usize> {
    // SAFETY: OneFd is plain old data (integers only); all zeroes is a valid value.
    let mut control: OneFd = unsafe { std::mem::zeroed() };
    control.header.cmsg_len = (size_of::<libc::cmsghdr>() + size_of::<RawFd>()) as _;
    control.header.cmsg_level = libc::SOL_SOCKET;
    control.header.cmsg_type = libc::SCM_RIGHTS;
    control.fd = fd;
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = (&mut control as *mut OneFd).cast();
    msg.msg_controllen = size_of::<OneFd>() as _;
    // SAFETY: `socket` is the stream's open descriptor; `msg` points to `iov` (over `bytes`) and
    // `control`, which outlive the call, and the kernel only reads them. MSG_NOSIGNAL turns a
    // closed peer into EPIPE instead of a signal.
    let sent = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if sent < 0 { Err(io::Error::last_os_error()) } else { Ok(sent as usize) }
}

/// Receives up to `buf.len()` bytes and at most one descriptor (a client's side, for tests).
pub fn recvmsg_with_fd(socket: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<std::os::fd::OwnedFd>)> {
    use std::os::fd::FromRawFd;
    // SAFETY: OneFd is plain old data; all zeroes is a valid value.
    let mut control: OneFd = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = (&mut control as *mut OneFd).cast();
    msg.msg_controllen = size_of::<OneFd>() as _;
    // SAFETY: `socket` is an open descriptor and `msg` points to buffers that outlive the call;
    // MSG_CMSG_CLOEXEC keeps a received descriptor from leaking into children.
    let got = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    let carried = msg.msg_controllen as usize >= size_of::<libc::cmsghdr>() + size_of::<RawFd>()
        && control.header.cmsg_level == libc::SOL_SOCKET
        && control.header.cmsg_type == libc::SCM_RIGHTS;
    // SAFETY: the kernel installed this descriptor for us with the message; nothing else owns it.
    let fd = carried.then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(control.fd) });
    Ok((got as usize, fd))
}
