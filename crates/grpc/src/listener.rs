//! Accepting connections so that nobody can hold them for free: a bounded number of
//! connections (total, and those still handshaking), a deadline for the handshake (TLS
//! and the HTTP/2 client preface), and an accept loop that backs off instead of spinning
//! when the process runs out of file descriptors.
//!
//! A connection takes a slot before it is accepted, so past the limit new connections
//! wait in the kernel's backlog instead of costing the process a descriptor. The limit is
//! clamped below the process's descriptor limit, leaving room for everything else the
//! process opens (the health and metrics ports, the shared store, outgoing calls), so
//! that a flood on the gRPC port cannot starve them. One address takes at most its share
//! of the connections (`server.max_connections_per_ip`).

use std::{
    collections::HashMap,
    future::Future,
    io,
    net::IpAddr,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore, mpsc},
};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The first bytes every HTTP/2 client sends (RFC 9113, section 3.4).
const PREFACE_LEN: usize = 24;
/// The header of an HTTP/2 frame; the client preface ends with a SETTINGS frame (type 4)
/// after the 24 bytes, whose payload is at most the default largest frame.
const FRAME_HEADER_LEN: usize = 9;
const SETTINGS: u8 = 4;
const MAX_FIRST_FRAME: usize = 16_384;

/// Reads the HTTP/2 client preface: the 24 bytes, then the SETTINGS frame that completes
/// it (a connection that sent the 24 bytes alone held its slot, outside the handshake
/// timeout, until the server's keepalive closed it).
async fn read_preface(io: &mut (impl AsyncRead + Unpin)) -> io::Result<Vec<u8>> {
    let mut preface = vec![0; PREFACE_LEN + FRAME_HEADER_LEN];
    io.read_exact(&mut preface).await?;
    let header = &preface[PREFACE_LEN..];
    let length =
        usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
    if header[3] != SETTINGS || length > MAX_FIRST_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the HTTP/2 client preface does not end with a SETTINGS frame",
        ));
    }
    preface.resize(PREFACE_LEN + FRAME_HEADER_LEN + length, 0);
    io.read_exact(&mut preface[PREFACE_LEN + FRAME_HEADER_LEN..])
        .await?;
    Ok(preface)
}

/// Descriptors kept free for what the process opens besides its gRPC connections.
pub(crate) const RESERVED_DESCRIPTORS: u64 = 256;

/// What a listener admits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Time from accept to a finished handshake (TLS, then the HTTP/2 preface).
    pub handshake_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections still handshaking at once.
    pub max_handshaking: usize,
    /// Connections open at once from one IP address (with the others, at most
    /// `max_connections`); past it, a new one from that address is closed at once.
    pub max_per_ip: usize,
    /// Whether the handshake waits for the HTTP/2 client preface (gRPC ports).
    pub preface: bool,
}

impl Limits {
    /// `max_connections` lowered, with a warning, to what the descriptor limit allows
    /// after reserving `reserved` descriptors for everything else.
    pub(crate) fn within_descriptor_limit(mut self, port: &'static str, reserved: u64) -> Self {
        let Some(limit) = descriptor_limit() else {
            return self;
        };
        let room = usize::try_from(limit.saturating_sub(reserved).max(16)).unwrap_or(usize::MAX);
        if self.max_connections > room {
            warn!(
                port,
                configured = self.max_connections,
                allowed = room,
                descriptor_limit = limit,
                "max connections lowered to fit the open-files limit (raise it with ulimit -n)"
            );
            self.max_connections = room;
        }
        self.max_handshaking = self.max_handshaking.min(self.max_connections);
        self
    }
}

/// The soft limit on open files of this process, when the platform says; raised first to
/// the hard limit, as far as the process may (a container often starts with a soft limit
/// of 1,024 under a far higher hard one, and nothing else in a pod can raise it).
fn descriptor_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    static RAISED: std::sync::Once = std::sync::Once::new();
    RAISED.call_once(|| {
        let limit = getrlimit(Resource::Nofile);
        if let (Some(current), Some(maximum)) = (limit.current, limit.maximum)
            && current < maximum
        {
            let raised = rustix::process::Rlimit {
                current: Some(maximum),
                maximum: Some(maximum),
            };
            match setrlimit(Resource::Nofile, raised) {
                Ok(()) => tracing::debug!(from = current, to = maximum, "open-files limit raised"),
                Err(error) => {
                    tracing::debug!(%error, current, maximum, "cannot raise the open-files limit");
                }
            }
        }
    });
    getrlimit(Resource::Nofile).current
}

/// A source of connections: a TCP listener, or a fake one in tests.
pub(crate) trait Listen: Send + 'static {
    /// The accepted connection.
    type Conn: Send + 'static;
    /// Accepts the next connection.
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Conn>> + Send;
    /// The address a connection comes from, when known.
    fn peer(_conn: &Self::Conn) -> Option<IpAddr> {
        None
    }
}

impl Listen for TcpListener {
    type Conn = TcpStream;

    async fn accept(&mut self) -> io::Result<TcpStream> {
        let (stream, _) = TcpListener::accept(self).await?;
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    fn peer(conn: &TcpStream) -> Option<IpAddr> {
        conn.peer_addr().ok().map(|addr| addr.ip())
    }
}

/// The connections open from each address, as [`admit`] counts them.
#[derive(Debug, Default)]
struct PerIp(Mutex<HashMap<IpAddr, usize>>);

impl PerIp {
    fn lock(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        // Each critical section leaves the map consistent before anything can panic.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A connection from `ip`, unless `most` are open from it already.
    fn take(self: &Arc<Self>, ip: IpAddr, most: usize) -> Option<IpSlot> {
        let mut open = self.lock();
        let count = open.entry(ip).or_insert(0);
        if *count >= most {
            return None;
        }
        *count += 1;
        Some(IpSlot(self.clone(), ip))
    }
}

/// One connection counted against its address until dropped.
#[derive(Debug)]
pub(crate) struct IpSlot(Arc<PerIp>, IpAddr);

impl Drop for IpSlot {
    fn drop(&mut self) {
        let mut open = self.0.lock();
        if let Some(count) = open.get_mut(&self.1) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.1);
            }
        }
    }
}

/// How often, at most, connections refused for their address are logged.
const REFUSED_WARNING_EVERY: Duration = Duration::from_secs(10);

/// Accepts connections from `listener` within `limits` until `stop` is cancelled (the
/// listener is then closed), running `handshake` (TLS, or nothing) on each and then
/// waiting for the HTTP/2 preface when `limits.preface` is set, all within the handshake
/// timeout. Yields the connections that got that far, each holding its slot until
/// dropped.
pub(crate) fn admit<L, H, Fut, IO>(
    port: &'static str,
    mut listener: L,
    limits: Limits,
    handshake: H,
    stop: CancellationToken,
) -> ReceiverStream<io::Result<Admitted<IO>>>
where
    L: Listen,
    H: Fn(L::Conn) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = io::Result<IO>> + Send + 'static,
    IO: AsyncRead + Unpin + Send + 'static,
{
    let (admitted, incoming) = mpsc::channel(64);
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let handshaking = Arc::new(Semaphore::new(limits.max_handshaking));
    let per_ip = Arc::new(PerIp::default());
    let handshake = Arc::new(handshake);
    tokio::spawn(async move {
        let mut backoff = Backoff::new(port);
        let refusals = agentrt_core::throttle::Throttle::new(REFUSED_WARNING_EVERY);
        loop {
            let slots = async {
                let connection = connections.clone().acquire_owned().await.ok()?;
                let handshaking = handshaking.clone().acquire_owned().await.ok()?;
                Some((connection, handshaking))
            };
            let (slot, handshake_slot) = tokio::select! {
                () = stop.cancelled() => return,
                slots = slots => match slots {
                    Some(slots) => slots,
                    None => return,
                },
            };
            let conn = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(conn) => {
                        backoff.reset();
                        conn
                    }
                    Err(error) => {
                        drop((slot, handshake_slot));
                        if let Some(pause) = backoff.after(&error) {
                            tokio::select! {
                                () = stop.cancelled() => return,
                                () = tokio::time::sleep(pause) => {}
                            }
                        }
                        continue;
                    }
                },
            };
            // One address may not take every slot: past its share, a new connection from
            // it is closed at once (its client sees the connection fail, and retries).
            let ip_slot = match L::peer(&conn) {
                Some(ip) if limits.max_per_ip < limits.max_connections => {
                    match per_ip.take(ip, limits.max_per_ip) {
                        Some(ip_slot) => Some(ip_slot),
                        None => {
                            drop(conn);
                            if let Some(left_out) = refusals.take() {
                                warn!(
                                    port,
                                    %ip,
                                    refused = left_out + 1,
                                    max_connections_per_ip = limits.max_per_ip,
                                    "connections refused: their address has its most open"
                                );
                            }
                            continue;
                        }
                    }
                }
                _ => None,
            };
            let handshake = handshake.clone();
            let admitted = admitted.clone();
            tokio::spawn(async move {
                let finished = tokio::time::timeout(limits.handshake_timeout, async {
                    let mut io = handshake(conn).await?;
                    let preface = if limits.preface {
                        read_preface(&mut io).await?
                    } else {
                        Vec::new()
                    };
                    Ok::<_, io::Error>((io, preface))
                })
                .await;
                drop(handshake_slot);
                match finished {
                    Ok(Ok((io, preface))) => {
                        let _ = admitted
                            .send(Ok(Admitted {
                                io,
                                preface,
                                replayed: 0,
                                _slot: slot,
                                _ip_slot: ip_slot,
                            }))
                            .await;
                    }
                    Ok(Err(error)) => debug!(port, %error, "handshake failed"),
                    Err(_) => debug!(port, "handshake timed out; connection closed"),
                }
            });
        }
    });
    ReceiverStream::new(incoming)
}

/// How the accept loop waits after a failed accept.
struct Backoff {
    port: &'static str,
    pause: Duration,
    failures: u64,
    last_warning: Option<Instant>,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(5);
    const MOST: Duration = Duration::from_secs(1);
    const WARN_EVERY: Duration = Duration::from_secs(10);

    fn new(port: &'static str) -> Self {
        Self {
            port,
            pause: Self::FIRST,
            failures: 0,
            last_warning: None,
        }
    }

    fn reset(&mut self) {
        if self.failures > 0 {
            info!(
                port = self.port,
                failures = self.failures,
                "accepting connections again"
            );
        }
        self.pause = Self::FIRST;
        self.failures = 0;
        self.last_warning = None;
    }

    /// The pause before the next accept after `error`: none for errors of one connection
    /// (it went away before it was accepted), a doubling one for errors of the process
    /// (out of descriptors or memory), with one warning per ten seconds.
    fn after(&mut self, error: &io::Error) -> Option<Duration> {
        if matches!(
            error.kind(),
            io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::Interrupted
                | io::ErrorKind::WouldBlock
        ) {
            debug!(port = self.port, %error, "a connection went away before it was accepted");
            return None;
        }
        self.failures += 1;
        if self
            .last_warning
            .is_none_or(|at| at.elapsed() >= Self::WARN_EVERY)
        {
            warn!(
                port = self.port,
                %error,
                failures = self.failures,
                pause = ?self.pause,
                "cannot accept connections; backing off"
            );
            self.last_warning = Some(Instant::now());
        }
        let pause = self.pause;
        self.pause = (self.pause * 2).min(Self::MOST);
        Some(pause)
    }
}

/// A connection past its handshake. It replays the preface it was admitted on and
/// holds its slot until dropped.
#[derive(Debug)]
pub(crate) struct Admitted<IO> {
    io: IO,
    preface: Vec<u8>,
    replayed: usize,
    _slot: OwnedSemaphorePermit,
    _ip_slot: Option<IpSlot>,
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Admitted<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.replayed < this.preface.len() {
            let rest = &this.preface[this.replayed..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.replayed += n;
            if this.replayed == this.preface.len() {
                this.preface = Vec::new();
                this.replayed = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use tokio::io::AsyncWriteExt;
    use tokio_stream::StreamExt;

    use super::*;

    /// A listener whose process is out of descriptors: every accept fails at once.
    struct OutOfDescriptors(Arc<AtomicU64>);

    impl Listen for OutOfDescriptors {
        type Conn = TcpStream;

        async fn accept(&mut self) -> io::Result<TcpStream> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Err(io::Error::from_raw_os_error(24)) // EMFILE
        }
    }

    /// The 24 bytes and a SETTINGS frame with one setting.
    const PREFACE: &[u8] =
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64";

    #[tokio::test]
    async fn a_preface_without_its_settings_frame_is_closed_at_the_handshake_timeout() {
        let (addr, _incoming, stop) = accepting(limits(true)).await;
        // The 24 bytes alone, and the 24 bytes with a frame that is not SETTINGS.
        for sent in [
            &PREFACE[..PREFACE_LEN],
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x06\x00\x00\x00\x00\x00".as_slice(),
        ] {
            let mut conn = TcpStream::connect(addr).await.unwrap();
            conn.write_all(sent).await.unwrap();
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut byte))
                .await
                .expect("the server closes a connection whose preface has no SETTINGS");
            assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        }
        stop.cancel();
    }

    /// A TCP port on localhost accepting within `limits`: its address, what it admits, and
    /// what stops it.
    async fn accepting(
        limits: Limits,
    ) -> (
        std::net::SocketAddr,
        ReceiverStream<io::Result<Admitted<TcpStream>>>,
        CancellationToken,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let incoming = admit(
            "test",
            listener,
            limits,
            |conn: TcpStream| async move { Ok(conn) },
            stop.clone(),
        );
        (addr, incoming, stop)
    }

    fn limits(preface: bool) -> Limits {
        Limits {
            handshake_timeout: Duration::from_millis(300),
            max_connections: 4,
            max_handshaking: 2,
            max_per_ip: 4,
            preface,
        }
    }

    #[tokio::test]
    async fn one_address_takes_at_most_its_share_of_the_connections() {
        let (addr, mut incoming, stop) = accepting(Limits {
            max_per_ip: 2,
            ..limits(true)
        })
        .await;
        let connect = || async {
            let mut client = TcpStream::connect(addr).await.unwrap();
            client.write_all(PREFACE).await.unwrap();
            client
        };
        let _clients = (connect().await, connect().await);
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(incoming.next().await.unwrap().unwrap());
        }
        // A third from the same address is closed at once, though slots are free.
        let mut third = connect().await;
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), third.read(&mut byte))
            .await
            .expect("the server closes a connection past its address's share");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        // One closed, the address may open another.
        held.pop();
        let _fourth = connect().await;
        let admitted = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(matches!(admitted, Ok(Some(Ok(_)))));
        stop.cancel();
    }

    #[tokio::test]
    async fn out_of_descriptors_the_loop_backs_off_instead_of_spinning() {
        let attempts = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let _incoming = admit(
            "test",
            OutOfDescriptors(attempts.clone()),
            limits(false),
            |conn: TcpStream| async move { Ok(conn) },
            stop.clone(),
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.cancel();
        // 5 ms doubling to 1 s: about 9 attempts in 2 s; a spinning loop makes millions.
        let made = attempts.load(Ordering::Relaxed);
        assert!((2..=12).contains(&made), "{made} accepts in 2 s");
    }

    #[tokio::test]
    async fn connections_past_the_limits_wait_and_silent_ones_are_closed() {
        let (addr, mut incoming, stop) = accepting(limits(true)).await;

        // Two silent connections fill the handshaking slots: a third that sends its
        // preface at once is not admitted until the silent ones time out.
        let mut silent = Vec::new();
        for _ in 0..2 {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut speaking = TcpStream::connect(addr).await.unwrap();
        speaking.write_all(PREFACE).await.unwrap();
        let waited = Instant::now();
        let mut first = incoming.next().await.unwrap().unwrap();
        assert!(
            waited.elapsed() >= Duration::from_millis(150),
            "admitted while the handshaking slots were full"
        );
        // The silent connections were closed by the server.
        for mut conn in silent {
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut byte))
                .await
                .expect("the server closes a connection that never sends its preface");
            assert!(matches!(read, Ok(0) | Err(_)));
        }
        // The preface is replayed to the HTTP/2 server.
        let mut preface = [0u8; PREFACE.len()];
        first.read_exact(&mut preface).await.unwrap();
        assert_eq!(&preface, PREFACE);

        // Four connections at most: the fifth waits until one is dropped.
        let mut held = vec![first];
        let mut clients = Vec::new();
        for _ in 0..4 {
            let mut client = TcpStream::connect(addr).await.unwrap();
            client.write_all(PREFACE).await.unwrap();
            clients.push(client);
        }
        for _ in 0..3 {
            held.push(incoming.next().await.unwrap().unwrap());
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(500), incoming.next())
                .await
                .is_err(),
            "a fifth connection was admitted past the limit of four"
        );
        held.pop();
        let admitted = tokio::time::timeout(Duration::from_secs(5), incoming.next()).await;
        assert!(matches!(admitted, Ok(Some(Ok(_)))));
        stop.cancel();
    }
}
