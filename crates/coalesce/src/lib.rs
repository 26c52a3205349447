//! I/O plumbing shared by the clients and servers: write coalescing for connections
//! that carry many streams.
//!
//! An HTTP/2 connection's task writes whenever one of its streams has a frame to send,
//! and tokio runs a task that another task wakes right after the waker (its LIFO slot):
//! under load every event of every stream became a write of its own, and each write on
//! loopback costs the sender the receiver's TCP work too. [`Coalesced`] makes the
//! connection task yield once before it writes, so the streams that are ready to run
//! produce their frames first and the frames go out together in one write. When nothing
//! else is ready the yield costs a task poll, not a wait. (Netty's
//! `FlushConsolidationHandler` does the same for the same reason.)

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// An I/O object whose writes wait one turn of the scheduler. See the module docs.
#[derive(Debug)]
pub struct Coalesced<T> {
    inner: T,
    /// Whether this write already yielded its turn.
    yielded: bool,
}

impl<T> Coalesced<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            yielded: false,
        }
    }

    /// The wrapped I/O object.
    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// Ready once this write has given other tasks their turn.
    fn poll_turn(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        // A task that wakes itself is queued behind the tasks already ready to run.
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    fn wrote<R>(&mut self, result: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if result.is_ready() {
            self.yielded = false;
        }
        result
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Coalesced<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Coalesced<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_turn(cx));
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_turn(cx));
        let result = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(result)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected for Coalesced<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_pass_through_both_ways() {
        let (a, b) = tokio::io::duplex(64);
        let (mut a, mut b) = (Coalesced::new(a), Coalesced::new(b));
        a.write_all(b"hello").await.unwrap();
        a.flush().await.unwrap();
        let mut got = [0; 5];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        b.write_all(b"back").await.unwrap();
        drop(b);
        let mut rest = Vec::new();
        a.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"back");
    }

    /// A write first lets the tasks already ready run, then goes out.
    #[tokio::test(flavor = "current_thread")]
    async fn a_write_yields_once_to_ready_tasks() {
        let (a, mut b) = tokio::io::duplex(64);
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let writer = tokio::spawn({
            let order = order.clone();
            async move {
                let mut a = Coalesced::new(a);
                order.lock().unwrap().push("writer starts");
                a.write_all(b"x").await.unwrap();
                order.lock().unwrap().push("writer wrote");
            }
        });
        let other = tokio::spawn({
            let order = order.clone();
            async move { order.lock().unwrap().push("other ran") }
        });
        writer.await.unwrap();
        other.await.unwrap();
        let mut got = [0; 1];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["writer starts", "other ran", "writer wrote"]
        );
    }
}
