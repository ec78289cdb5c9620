//! The `h3` QUIC traits over `quinn`, with stream priority classes.
//!
//! `h3-quinn` hides the `quinn::SendStream` under `h3`'s request streams, so nothing above it
//! can call `quinn::SendStream::set_priority`, and the tunnel's priority classes (ARCHITECTURE,
//! "The tunnel, layer by layer", item 1: control > interactive > bulk) could not be expressed.
//! This adapter implements the same traits and adds one thing: every bidirectional send stream is
//! registered, by its `h3` stream id, in the connection's [`PriorityMap`], so the code holding
//! an `h3` `RequestStream` (which only exposes `id()`) can set its priority:
//!
//! ```ignore
//! let conn = h3_quinn_prio::Connection::new(quinn_conn);
//! let priorities = conn.priorities();
//! // ... build the h3 server or client on `conn`, get a request stream ...
//! priorities.set(stream.id(), Priority::Bulk);
//! ```
//!
//! The map holds weak references, and a stream removes its entry when it is dropped, so the map
//! never holds more entries than there are live request streams. Unidirectional streams (the
//! HTTP/3 control and QPACK streams) are sent as [`Priority::Control`] and are not registered.
//!
//! quinn sends the pending stream of the highest priority first. Beware of
//! `TransportConfig::send_fairness(false)`: quinn then finishes the buffered data of a stream it
//! has started writing before it looks at priorities again, so a higher class overtakes a lower
//! one only where the lower one's send buffer runs dry.
//!
//! This module must never buffer stream data beyond the one `WriteBuf` that `h3`'s contract
//! allows (`send_data` then `poll_ready`), and never panic on anything the peer does.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use futures_util::stream::{self, Stream, StreamExt};
use h3::error::Code;
use h3::quic::{self, ConnectionErrorIncoming, StreamErrorIncoming, StreamId, WriteBuf};
use quinn::VarInt;

/// The priority class of a send stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Priority {
    /// Health checks, metrics, model lists, CONNECT relays and HTTP/3's own control streams.
    Control,
    /// First tokens and short messages (the default of a new request stream).
    #[default]
    Interactive,
    /// Long prompts, files, large non-streaming bodies.
    Bulk,
}

impl Priority {
    /// The value handed to `quinn::SendStream::set_priority` (quinn sends higher values first).
    pub const fn quinn_value(self) -> i32 {
        match self {
            Priority::Control => 2,
            Priority::Interactive => 1,
            Priority::Bulk => 0,
        }
    }
}

/// Bodies larger than this many bytes travel as [`Priority::Bulk`].
pub const BULK_BODY_BYTES: u64 = 64 * 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A quinn send stream and the class it was last given, shared by the stream and its entry in
/// the [`PriorityMap`].
struct Slot {
    stream: quinn::SendStream,
    priority: Priority,
}

impl Slot {
    fn set(&mut self, priority: Priority) {
        if self.priority != priority {
            // A stream that is already closed has nothing left to schedule.
            let _ = self.stream.set_priority(priority.quinn_value());
            self.priority = priority;
        }
    }
}

type SlotRef = Arc<Mutex<Slot>>;

/// The live bidirectional send streams of one connection, by `h3` stream id.
///
/// Cheap to clone; every clone sees the same streams.
#[derive(Clone, Default)]
pub struct PriorityMap {
    streams: Arc<Mutex<HashMap<StreamId, Weak<Mutex<Slot>>>>>,
}

impl fmt::Debug for PriorityMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PriorityMap")
            .field("streams", &self.len())
            .finish()
    }
}

impl PriorityMap {
    /// Sets the priority of the send side of stream `id`. Returns `false` when no such stream is
    /// open (it ended, or it is not a request stream of this connection).
    pub fn set(&self, id: StreamId, priority: Priority) -> bool {
        let Some(slot) = self.slot(id) else {
            return false;
        };
        lock(&slot).set(priority);
        true
    }

    /// The priority of the send side of stream `id`, while it is open.
    pub fn get(&self, id: StreamId) -> Option<Priority> {
        self.slot(id).map(|slot| lock(&slot).priority)
    }

    /// A future that completes when the peer no longer wants the send side of stream `id`: it
    /// sent STOP_SENDING, or the connection is gone. A server races its work for the request
    /// against it, so a client that cancels (or whose connection dies) frees the work at once
    /// instead of at the first write that fails. `None` when no such stream is open.
    ///
    /// It also completes once this side has finished the stream and the peer acknowledged all of
    /// it; by then the work it guards is done.
    pub fn stopped(&self, id: StreamId) -> Option<impl Future<Output = ()> + Send + 'static> {
        let slot = self.slot(id)?;
        let stopped = lock(&slot).stream.stopped();
        Some(async move {
            let _ = stopped.await;
        })
    }

    /// How many streams are registered.
    pub fn len(&self) -> usize {
        lock(&self.streams).len()
    }

    /// Whether no stream is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn slot(&self, id: StreamId) -> Option<SlotRef> {
        lock(&self.streams).get(&id).and_then(Weak::upgrade)
    }

    fn insert(&self, id: StreamId, slot: &SlotRef) {
        // A 0-RTT rejection restarts quinn's stream numbering, so an id may come back while the
        // discarded stream that had it still exists: the newest stream wins.
        lock(&self.streams).insert(id, Arc::downgrade(slot));
    }

    fn remove(&self, id: StreamId, slot: &SlotRef) {
        let mut streams = lock(&self.streams);
        let ours = streams
            .get(&id)
            .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(slot)));
        if ours {
            streams.remove(&id);
        }
    }
}

fn h3_id(id: quinn::StreamId) -> StreamId {
    StreamId::try_from(u64::from(id)).expect("a QUIC stream id is a varint, below 2^62")
}

fn connection_error(e: quinn::ConnectionError) -> ConnectionErrorIncoming {
    match e {
        quinn::ConnectionError::ApplicationClosed(close) => {
            ConnectionErrorIncoming::ApplicationClose {
                error_code: close.error_code.into_inner(),
            }
        }
        quinn::ConnectionError::TimedOut => ConnectionErrorIncoming::Timeout,
        other => ConnectionErrorIncoming::Undefined(Arc::new(other)),
    }
}

fn stream_connection_error(e: quinn::ConnectionError) -> StreamErrorIncoming {
    StreamErrorIncoming::ConnectionErrorIncoming {
        connection_error: connection_error(e),
    }
}

fn read_error(e: quinn::ReadError) -> StreamErrorIncoming {
    match e {
        quinn::ReadError::Reset(code) => StreamErrorIncoming::StreamTerminated {
            error_code: code.into_inner(),
        },
        quinn::ReadError::ConnectionLost(e) => stream_connection_error(e),
        other => StreamErrorIncoming::Unknown(Box::new(other)),
    }
}

fn write_error(e: quinn::WriteError) -> StreamErrorIncoming {
    match e {
        quinn::WriteError::Stopped(code) => StreamErrorIncoming::StreamTerminated {
            error_code: code.into_inner(),
        },
        quinn::WriteError::ConnectionLost(e) => stream_connection_error(e),
        other => StreamErrorIncoming::Unknown(Box::new(other)),
    }
}

fn misuse(what: &str) -> StreamErrorIncoming {
    // h3 closes the connection with H3_INTERNAL_ERROR on this error.
    StreamErrorIncoming::ConnectionErrorIncoming {
        connection_error: ConnectionErrorIncoming::InternalError(format!(
            "h3 adapter misuse: {what}"
        )),
    }
}

/// A stream of the results of a quinn accept or open future, polled one result at a time. One
/// allocation per connection instead of one per stream.
type Pending<T> = Pin<Box<dyn Stream<Item = Result<T, quinn::ConnectionError>> + Send + Sync>>;

type Bi = (quinn::SendStream, quinn::RecvStream);

fn accept_bi(conn: quinn::Connection) -> Pending<Bi> {
    Box::pin(stream::unfold(conn, |conn| async {
        Some((conn.accept_bi().await, conn))
    }))
}

fn accept_uni(conn: quinn::Connection) -> Pending<quinn::RecvStream> {
    Box::pin(stream::unfold(conn, |conn| async {
        Some((conn.accept_uni().await, conn))
    }))
}

fn open_bi(conn: quinn::Connection) -> Pending<Bi> {
    Box::pin(stream::unfold(conn, |conn| async {
        Some((conn.open_bi().await, conn))
    }))
}

fn open_uni(conn: quinn::Connection) -> Pending<quinn::SendStream> {
    Box::pin(stream::unfold(conn, |conn| async {
        Some((conn.open_uni().await, conn))
    }))
}

fn poll_pending<T>(
    pending: &mut Pending<T>,
    cx: &mut Context<'_>,
) -> Poll<Result<T, quinn::ConnectionError>> {
    match ready!(pending.poll_next_unpin(cx)) {
        Some(result) => Poll::Ready(result),
        // `unfold` above yields forever; treat an end like a closed connection all the same.
        None => Poll::Ready(Err(quinn::ConnectionError::LocallyClosed)),
    }
}

fn close(conn: &quinn::Connection, code: Code, reason: &[u8]) {
    let code = VarInt::from_u64(code.value()).unwrap_or_else(|_| {
        VarInt::from_u64(Code::H3_INTERNAL_ERROR.value()).unwrap_or(VarInt::MAX)
    });
    conn.close(code, reason);
}

/// An HTTP/3 connection's QUIC side: implements [`quic::Connection`] over a `quinn::Connection`.
pub struct Connection {
    conn: quinn::Connection,
    incoming_bi: Pending<Bi>,
    incoming_uni: Pending<quinn::RecvStream>,
    opener: OpenStreams,
}

impl Connection {
    /// Wraps `conn`, with a fresh [`PriorityMap`].
    pub fn new(conn: quinn::Connection) -> Self {
        Self {
            incoming_bi: accept_bi(conn.clone()),
            incoming_uni: accept_uni(conn.clone()),
            opener: OpenStreams::new(conn.clone(), PriorityMap::default()),
            conn,
        }
    }

    /// The priorities of this connection's request streams.
    pub fn priorities(&self) -> PriorityMap {
        self.opener.priorities.clone()
    }

    /// The wrapped quinn connection.
    pub fn quinn(&self) -> &quinn::Connection {
        &self.conn
    }
}

impl<B: Buf> quic::Connection<B> for Connection {
    type RecvStream = RecvStream;
    type OpenStreams = OpenStreams;

    fn poll_accept_recv(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::RecvStream, ConnectionErrorIncoming>> {
        let recv = ready!(poll_pending(&mut self.incoming_uni, cx)).map_err(connection_error)?;
        Poll::Ready(Ok(RecvStream::new(recv)))
    }

    fn poll_accept_bidi(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::BidiStream, ConnectionErrorIncoming>> {
        let (send, recv) =
            ready!(poll_pending(&mut self.incoming_bi, cx)).map_err(connection_error)?;
        Poll::Ready(Ok(BidiStream::new(send, recv, &self.opener.priorities)))
    }

    fn opener(&self) -> Self::OpenStreams {
        self.opener.clone()
    }
}

impl<B: Buf> quic::OpenStreams<B> for Connection {
    type BidiStream = BidiStream<B>;
    type SendStream = SendStream<B>;

    fn poll_open_bidi(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::BidiStream, StreamErrorIncoming>> {
        quic::OpenStreams::<B>::poll_open_bidi(&mut self.opener, cx)
    }

    fn poll_open_send(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::SendStream, StreamErrorIncoming>> {
        quic::OpenStreams::<B>::poll_open_send(&mut self.opener, cx)
    }

    fn close(&mut self, code: Code, reason: &[u8]) {
        close(&self.conn, code, reason);
    }
}

/// Opens outgoing streams (implements [`quic::OpenStreams`]); every clone shares the
/// connection's [`PriorityMap`].
pub struct OpenStreams {
    conn: quinn::Connection,
    priorities: PriorityMap,
    opening_bi: Option<Pending<Bi>>,
    opening_uni: Option<Pending<quinn::SendStream>>,
}

impl OpenStreams {
    fn new(conn: quinn::Connection, priorities: PriorityMap) -> Self {
        Self {
            conn,
            priorities,
            opening_bi: None,
            opening_uni: None,
        }
    }

    /// The priorities of this connection's request streams.
    pub fn priorities(&self) -> PriorityMap {
        self.priorities.clone()
    }
}

impl Clone for OpenStreams {
    fn clone(&self) -> Self {
        // An open in progress belongs to the original; the clone starts its own when asked.
        Self::new(self.conn.clone(), self.priorities.clone())
    }
}

impl<B: Buf> quic::OpenStreams<B> for OpenStreams {
    type BidiStream = BidiStream<B>;
    type SendStream = SendStream<B>;

    fn poll_open_bidi(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::BidiStream, StreamErrorIncoming>> {
        let conn = &self.conn;
        let pending = self.opening_bi.get_or_insert_with(|| open_bi(conn.clone()));
        let (send, recv) = ready!(poll_pending(pending, cx)).map_err(stream_connection_error)?;
        Poll::Ready(Ok(BidiStream::new(send, recv, &self.priorities)))
    }

    fn poll_open_send(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::SendStream, StreamErrorIncoming>> {
        let conn = &self.conn;
        let pending = self
            .opening_uni
            .get_or_insert_with(|| open_uni(conn.clone()));
        let send = ready!(poll_pending(pending, cx)).map_err(stream_connection_error)?;
        Poll::Ready(Ok(SendStream::new(send, Priority::Control, None)))
    }

    fn close(&mut self, code: Code, reason: &[u8]) {
        close(&self.conn, code, reason);
    }
}

/// A bidirectional (request) stream; implements [`quic::BidiStream`].
pub struct BidiStream<B: Buf> {
    send: SendStream<B>,
    recv: RecvStream,
}

impl<B: Buf> BidiStream<B> {
    fn new(send: quinn::SendStream, recv: quinn::RecvStream, priorities: &PriorityMap) -> Self {
        Self {
            send: SendStream::new(send, Priority::default(), Some(priorities.clone())),
            recv: RecvStream::new(recv),
        }
    }

    /// Sets the priority of the send side.
    pub fn set_priority(&self, priority: Priority) {
        self.send.set_priority(priority);
    }

    /// The priority of the send side.
    pub fn priority(&self) -> Priority {
        self.send.priority()
    }
}

impl<B: Buf> quic::BidiStream<B> for BidiStream<B> {
    type SendStream = SendStream<B>;
    type RecvStream = RecvStream;

    fn split(self) -> (Self::SendStream, Self::RecvStream) {
        (self.send, self.recv)
    }
}

impl<B: Buf> quic::SendStream<B> for BidiStream<B> {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.send.poll_ready(cx)
    }

    fn send_data<T: Into<WriteBuf<B>>>(&mut self, data: T) -> Result<(), StreamErrorIncoming> {
        self.send.send_data(data)
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        self.send.poll_finish(cx)
    }

    fn reset(&mut self, reset_code: u64) {
        self.send.reset(reset_code);
    }

    fn send_id(&self) -> StreamId {
        self.send.send_id()
    }
}

impl<B: Buf> quic::SendStreamUnframed<B> for BidiStream<B> {
    fn poll_send<D: Buf>(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut D,
    ) -> Poll<Result<usize, StreamErrorIncoming>> {
        self.send.poll_send(cx, buf)
    }
}

impl<B: Buf> quic::RecvStream for BidiStream<B> {
    type Buf = Bytes;

    fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Self::Buf>, StreamErrorIncoming>> {
        self.recv.poll_data(cx)
    }

    fn stop_sending(&mut self, error_code: u64) {
        self.recv.stop_sending(error_code);
    }

    fn recv_id(&self) -> StreamId {
        self.recv.recv_id()
    }
}

/// The send side of a stream; implements [`quic::SendStream`] and carries a [`Priority`].
pub struct SendStream<B: Buf> {
    slot: SlotRef,
    id: StreamId,
    /// Where the stream is registered (bidirectional streams only).
    registry: Option<PriorityMap>,
    /// The frame `h3` handed over with `send_data`, written out by `poll_ready`.
    writing: Option<WriteBuf<B>>,
    /// Finished or reset: dropped before that, the stream is reset, not ended (quinn would end
    /// it with a FIN, and a cut response or request would read as complete).
    closed: bool,
}

impl<B: Buf> SendStream<B> {
    fn new(stream: quinn::SendStream, priority: Priority, registry: Option<PriorityMap>) -> Self {
        let id = h3_id(stream.id());
        // quinn's default priority is 0, which is Bulk's value: set it explicitly.
        let _ = stream.set_priority(priority.quinn_value());
        let slot = Arc::new(Mutex::new(Slot { stream, priority }));
        if let Some(map) = &registry {
            map.insert(id, &slot);
        }
        Self {
            slot,
            id,
            registry,
            writing: None,
            closed: false,
        }
    }

    /// Sets the priority of this stream.
    pub fn set_priority(&self, priority: Priority) {
        lock(&self.slot).set(priority);
    }

    /// The priority of this stream.
    pub fn priority(&self) -> Priority {
        lock(&self.slot).priority
    }
}

impl<B: Buf> Drop for SendStream<B> {
    fn drop(&mut self) {
        if let Some(map) = &self.registry {
            map.remove(self.id, &self.slot);
        }
        if !self.closed {
            // H3_REQUEST_CANCELLED (RFC 9114 section 8.1).
            let _ = lock(&self.slot).stream.reset(VarInt::from_u32(0x10c));
        }
    }
}

impl<B: Buf> quic::SendStream<B> for SendStream<B> {
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        let Some(data) = self.writing.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        let mut slot = lock(&self.slot);
        while data.has_remaining() {
            let written = ready!(Pin::new(&mut slot.stream).poll_write(cx, data.chunk()))
                .map_err(write_error)?;
            data.advance(written);
        }
        drop(slot);
        self.writing = None;
        Poll::Ready(Ok(()))
    }

    fn send_data<T: Into<WriteBuf<B>>>(&mut self, data: T) -> Result<(), StreamErrorIncoming> {
        if self.writing.is_some() {
            return Err(misuse("send_data before the previous frame was written"));
        }
        self.writing = Some(data.into());
        Ok(())
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), StreamErrorIncoming>> {
        // A frame still being written goes out before the FIN.
        ready!(self.poll_ready(cx))?;
        self.closed = true;
        Poll::Ready(
            lock(&self.slot)
                .stream
                .finish()
                .map_err(|e| StreamErrorIncoming::Unknown(Box::new(e))),
        )
    }

    fn reset(&mut self, reset_code: u64) {
        self.closed = true;
        let code = VarInt::from_u64(reset_code).unwrap_or(VarInt::MAX);
        let _ = lock(&self.slot).stream.reset(code);
    }

    fn send_id(&self) -> StreamId {
        self.id
    }
}

impl<B: Buf> quic::SendStreamUnframed<B> for SendStream<B> {
    fn poll_send<D: Buf>(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut D,
    ) -> Poll<Result<usize, StreamErrorIncoming>> {
        if self.writing.is_some() {
            return Poll::Ready(Err(misuse("poll_send while a frame is being written")));
        }
        let mut slot = lock(&self.slot);
        let written =
            ready!(Pin::new(&mut slot.stream).poll_write(cx, buf.chunk())).map_err(write_error)?;
        buf.advance(written);
        Poll::Ready(Ok(written))
    }
}

/// The receive side of a stream; implements [`quic::RecvStream`].
pub struct RecvStream {
    stream: quinn::RecvStream,
    id: StreamId,
}

impl RecvStream {
    fn new(stream: quinn::RecvStream) -> Self {
        Self {
            id: h3_id(stream.id()),
            stream,
        }
    }
}

impl quic::RecvStream for RecvStream {
    type Buf = Bytes;

    fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Self::Buf>, StreamErrorIncoming>> {
        // `read_chunk` is cancel-safe and keeps no state of its own (quinn keeps the waker), so
        // a future made afresh for each poll is equivalent to one kept across polls, and needs
        // no allocation.
        let read = pin!(self.stream.read_chunk(usize::MAX, true));
        let chunk = ready!(read.poll(cx)).map_err(read_error)?;
        Poll::Ready(Ok(chunk.map(|c| c.bytes)))
    }

    fn stop_sending(&mut self, error_code: u64) {
        let code = VarInt::from_u64(error_code).unwrap_or(VarInt::MAX);
        let _ = self.stream.stop(code);
    }

    fn recv_id(&self) -> StreamId {
        self.id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_map_to_quinn_order() {
        assert!(Priority::Control.quinn_value() > Priority::Interactive.quinn_value());
        assert!(Priority::Interactive.quinn_value() > Priority::Bulk.quinn_value());
        assert_eq!(Priority::default(), Priority::Interactive);
    }

    #[test]
    fn unknown_streams_are_not_set() {
        let map = PriorityMap::default();
        let id = StreamId::try_from(0u64).expect("0 is a valid id");
        assert!(!map.set(id, Priority::Bulk));
        assert_eq!(map.get(id), None);
        assert!(map.is_empty());
    }
}
