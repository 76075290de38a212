package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// The replay socket speaks vLLM's protocol as a ROUTER: a subscriber that missed batches sends
// [empty delimiter, start sequence number (8 bytes big-endian)] — what a DEALER sends with an
// explicit delimiter and a REQ socket sends on its own — and receives, for every kept batch from
// that number on, [empty, sequence number, payload], then the end marker [empty, -1 as 8 bytes,
// empty]. Each connection is answered on its own: zmq4's ROUTER socket routes replies by the peer's
// identity, which anonymous peers share, so the server runs ZMTP per connection (zmq4.Open)
// instead.

// endSeq is vLLM's END_SEQ: -1 as 8 bytes big-endian, two's complement.
var endSeq = bytes.Repeat([]byte{0xff}, 8)

// Limits of the replay server: an untrusted subscriber holds a connection for at most
// replayIdle between requests and replayWrite per message, and at most replayConns connect at once.
const (
	replayHandshake = 5 * time.Second
	replayIdle      = 5 * time.Minute
	replayWrite     = 10 * time.Second
	replayConns     = 32
)

// entry is one kept batch.
type entry struct {
	seq     uint64
	payload []byte
}

// replayServer keeps the last batches and answers replay requests. It owns an accept goroutine
// and one goroutine per connection, all ended by close.
type replayServer struct {
	ln    net.Listener
	log   *slog.Logger
	limit int // BufferSteps

	mu     sync.Mutex
	kept   []entry // oldest first, at most limit
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// startReplay binds ep (tcp or ipc) and starts accepting.
func startReplay(ep string, limit int, log *slog.Logger) (*replayServer, error) {
	e, err := splitEndpoint(ep)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen(e.network, e.addr)
	if err != nil {
		return nil, err
	}
	s := &replayServer{ln: ln, log: log, limit: limit, conns: make(map[net.Conn]struct{})}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// keep records a sent batch, forgetting the oldest beyond the limit.
func (s *replayServer) keep(seq uint64, payload []byte) {
	if s.limit == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.kept) >= s.limit {
		s.kept[0] = entry{}
		s.kept = s.kept[1:]
	}
	s.kept = append(s.kept, entry{seq, payload})
}

// from returns the kept batches with sequence numbers ≥ start.
func (s *replayServer) from(start uint64) []entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, e := range s.kept {
		if e.seq >= start {
			return append([]entry(nil), s.kept[i:]...)
		}
	}
	return nil
}

// accept serves connections until the listener closes.
func (s *replayServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		if s.closed || len(s.conns) >= replayConns {
			s.mu.Unlock()
			c.Close()
			continue
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

// serve answers one connection's requests until it fails, idles out or the server closes.
func (s *replayServer) serve(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		c.Close()
	}()
	if err := c.SetDeadline(time.Now().Add(replayHandshake)); err != nil {
		return
	}
	zc, err := zmq4.Open(c, null.Security(), zmq4.Router, nil, true, nil)
	if err != nil {
		s.log.Debug("kvevents: replay handshake failed", "peer", c.RemoteAddr(), "err", err)
		return
	}
	for {
		if err := c.SetDeadline(time.Now().Add(replayIdle)); err != nil {
			return
		}
		msg, err := zc.RecvMsg()
		if err != nil {
			return
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		start, err := parseReplayRequest(msg.Frames)
		if err != nil {
			s.log.Warn("kvevents: invalid replay request", "peer", c.RemoteAddr(), "err", err)
			continue
		}
		for _, e := range s.from(start) {
			var seqb [8]byte
			binary.BigEndian.PutUint64(seqb[:], e.seq)
			if err := s.send(c, zc, seqb[:], e.payload); err != nil {
				return
			}
		}
		if err := s.send(c, zc, endSeq, nil); err != nil {
			return
		}
	}
}

// send writes one reply [empty, seq, payload] with a deadline.
func (s *replayServer) send(c net.Conn, zc *zmq4.Conn, seq, payload []byte) error {
	if err := c.SetWriteDeadline(time.Now().Add(replayWrite)); err != nil {
		return err
	}
	return zc.SendMsg(zmq4.NewMsgFrom([]byte{}, seq, payload))
}

// parseReplayRequest returns the start sequence number of a request [empty, seq], the seq being
// a big-endian integer of at most 8 bytes.
func parseReplayRequest(frames [][]byte) (uint64, error) {
	if len(frames) != 2 || len(frames[0]) != 0 {
		return 0, fmt.Errorf("want [empty delimiter, start sequence], got %d frames", len(frames))
	}
	if n := len(frames[1]); n == 0 || n > 8 {
		return 0, fmt.Errorf("start sequence of %d bytes, want 1 to 8", n)
	}
	var b [8]byte
	copy(b[8-len(frames[1]):], frames[1])
	return binary.BigEndian.Uint64(b[:]), nil
}

// close stops accepting, closes every connection and waits for the goroutines.
func (s *replayServer) close() error {
	err := s.ln.Close()
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}
