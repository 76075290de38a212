package transfer

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/kvbridge/kvbridge/transfer/internal/wire"
)

// Connection roles announced in the hello.
const (
	roleControl uint8 = 1 // notifications (both directions) and liveness
	roleData    uint8 = 2 // TCP READ/WRITE frames
	roleMeta    uint8 = 3 // answer with the metadata blob, then close
	roleArenas  uint8 = 4 // Unix only: answer with arena fds, then close
)

// roleName returns the HelloInfo role string.
func roleName(r uint8) string {
	switch r {
	case roleControl:
		return "control"
	case roleData:
		return "data"
	case roleMeta:
		return "metadata"
	case roleArenas:
		return "arenas"
	}
	return fmt.Sprintf("role(%d)", r)
}

// hello is the first frame's payload on every connection (dialer → listener).
type hello struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
	_msgpack struct{} `msgpack:",as_array"`
	Version  uint8
	Role     uint8
	From     string
	FromInc  uint64
	To       string
	ToInc    uint64
	Arenas   []uint32 // arena ids whose fds the dialer wants (control/arenas roles on Unix)
	Nonce    []byte   // the dialer's authentication nonce; empty when it has no Config.Auth
}

// helloAck answers a hello.
type helloAck struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
	_msgpack struct{} `msgpack:",as_array"`
	Name     string
	Inc      uint64
	Grants   []arenaGrant // one per passed fd, in order
	Meta     []byte       // metadata blob (roleMeta)
}

// arenaGrant describes one passed arena fd.
type arenaGrant struct {
	//lint:ignore U1000 msgpack reads its tag (as_array)
	_msgpack struct{} `msgpack:",as_array"`
	ID       uint32
	Size     uint64
	Writable bool
}

// info returns the HelloInfo view of h.
func (h *hello) info() helloInfo {
	return helloInfo{Role: roleName(h.Role), From: h.From, FromIncarnation: h.FromInc, To: h.To, ToIncarnation: h.ToInc}
}

// Frame limits for what a listener accepts from a peer before and after the hello.
const (
	maxHelloBytes = 64 << 10
	maxAckBytes   = maxMetadataBytes + 4096
	maxFDsPerAck  = 250 // SCM_MAX_FD is 253
	maxErrorBytes = 4096
)

// dataLimits returns the limits a receiver applies to data/control frames.
func (a *Agent) dataLimits() wire.Limits {
	return wire.Limits{MaxRanges: maxRangesPerFrame, MaxPayload: maxStripeBytes, MaxControl: uint64(a.cfg.MaxNotifBytes), MaxTag: maxTagBytes}
}

// encodeFrame returns header+payload as one buffer.
func encodeFrame(h wire.Header, payload []byte) []byte {
	h.Length = uint64(len(payload))
	b := make([]byte, wire.HeaderSize+len(payload))
	h.Encode(b)
	copy(b[wire.HeaderSize:], payload)
	return b
}

// errorFrame encodes an OpError frame answering (req, seq) with kind and a message.
func errorFrame(req uint64, seq uint32, kind error, msg string) []byte {
	if len(msg) > maxErrorBytes {
		msg = msg[:maxErrorBytes]
	}
	return encodeFrame(wire.Header{Op: wire.OpError, Req: req, Seq: seq, Count: codeFor(kind)}, []byte(msg))
}

// readHeader reads and validates one frame header.
func readHeader(r io.Reader, buf []byte, lim wire.Limits) (wire.Header, error) {
	if _, err := io.ReadFull(r, buf[:wire.HeaderSize]); err != nil {
		return wire.Header{}, err
	}
	h, err := wire.DecodeHeader(buf[:wire.HeaderSize])
	if err == nil {
		err = lim.Check(h)
	}
	if err != nil {
		return h, fmt.Errorf("%w: %v", ErrProtocol, err)
	}
	return h, nil
}

// readPayload reads exactly n bytes into a new buffer.
func readPayload(r io.Reader, n uint64) ([]byte, error) {
	b := make([]byte, n)
	_, err := io.ReadFull(r, b)
	return b, err
}

// dialResult is an established, handshaken connection.
type dialResult struct {
	conn net.Conn
	ack  helloAck
	fds  []int // received arena fds (Unix), owned by the caller
}

// dial connects to addr ("unix" or "tcp"), sends a hello and waits for the ack. Errors are
// ErrRemoteDisconnect for connection failures, ErrProtocol for malformed answers and the
// listener's refusal kind (ErrStaleIncarnation, ErrPermission, …) otherwise.
func (a *Agent) dial(ctx context.Context, network, addr string, h hello) (*dialResult, error) {
	deadline := time.Now().Add(a.cfg.DialTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	h.Version = 1
	h.From, h.FromInc = a.name, a.inc
	if a.cfg.Auth != nil {
		h.Nonce = make([]byte, authNonceBytes)
		if _, err := rand.Read(h.Nonce); err != nil {
			return nil, newErr("connect", h.To, ErrBackend, "drawing a nonce", err)
		}
	}
	payload, err := msgpack.Marshal(&h)
	if err != nil {
		return nil, newErr("connect", h.To, ErrInvalidParam, "encoding hello", err)
	}
	d := net.Dialer{Deadline: deadline}
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, newErr("connect", h.To, ErrRemoteDisconnect, fmt.Sprintf("dial %s %s", network, addr), err)
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tuneTCP(tc)
	}
	_ = c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	res, err := a.handshake(c, addr, h, payload)
	if err != nil {
		c.Close()
		if ctx.Err() != nil {
			return nil, newErr("connect", h.To, ErrCanceled, fmt.Sprintf("%s %s", network, addr), ctx.Err())
		}
		var e *Error
		if errors.As(err, &e) {
			return nil, err
		}
		if errors.Is(err, ErrProtocol) {
			return nil, newErr("connect", h.To, ErrProtocol, fmt.Sprintf("%s %s", network, addr), err)
		}
		return nil, newErr("connect", h.To, ErrRemoteDisconnect, fmt.Sprintf("handshake %s %s", network, addr), err)
	}
	_ = c.SetDeadline(time.Time{})
	return res, nil
}

// handshake sends the hello, answers the listener's challenge when authenticating, and reads
// the ack (and fds on a Unix socket).
func (a *Agent) handshake(c net.Conn, addr string, h hello, payload []byte) (*dialResult, error) {
	if _, err := c.Write(encodeFrame(wire.Header{Op: wire.OpHello}, payload)); err != nil {
		return nil, err
	}
	hdr, body, fds, err := readAnswer(c)
	if err != nil {
		return nil, err
	}
	closeFDs := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	var ch *challenge
	if hdr.Op == wire.OpChallenge {
		closeFDs() // none are passed with a challenge
		if ch, err = a.answerChallenge(c, addr, &h, body); err != nil {
			return nil, err
		}
		if hdr, body, fds, err = readAnswer(c); err != nil {
			return nil, err
		}
	}
	res, err := a.acceptAnswer(addr, &h, ch, hdr, body, fds)
	if err != nil {
		closeFDs()
		return nil, err
	}
	res.conn = c
	return res, nil
}

// acceptAnswer checks the listener's final answer to a hello (after its challenge ch, if
// it sent one): a HELLO_ACK from the agent the hello named, with as many arena grants as
// fds. On error the caller closes the fds.
func (a *Agent) acceptAnswer(addr string, h *hello, ch *challenge, hdr wire.Header, body []byte, fds []int) (*dialResult, error) {
	switch hdr.Op {
	case wire.OpError:
		return nil, newErr("connect", h.To, kindForCode(hdr.Count), fmt.Sprintf("refused by peer at %s: %s", addr, body), nil)
	case wire.OpHelloAck:
	default:
		return nil, fmt.Errorf("%w: unexpected %v during handshake", ErrProtocol, hdr.Op)
	}
	if a.cfg.Auth != nil && ch == nil {
		why := fmt.Sprintf("peer at %s accepted the connection without authenticating: it has no shared secret configured, this agent has one", addr)
		a.countAuthRefusal("dialer", h.To, addr, roleName(h.Role), why)
		return nil, newErr("connect", h.To, ErrPermission, why, nil)
	}
	res := &dialResult{fds: fds}
	if _, err := checkMsgpack(body, 4); err != nil {
		return nil, err
	}
	if err := msgpack.Unmarshal(body, &res.ack); err != nil {
		return nil, fmt.Errorf("%w: hello ack: %v", ErrProtocol, err)
	}
	if len(res.ack.Grants) != len(fds) {
		return nil, fmt.Errorf("%w: %d arena grants for %d fds", ErrProtocol, len(res.ack.Grants), len(fds))
	}
	if ch != nil && (res.ack.Name != ch.Name || res.ack.Inc != ch.Inc) {
		return nil, fmt.Errorf("%w: acknowledged as %s/%016x after a challenge from %s/%016x", ErrProtocol, res.ack.Name, res.ack.Inc, ch.Name, ch.Inc)
	}
	if h.To != "" && (res.ack.Name != h.To || (h.ToInc != 0 && res.ack.Inc != h.ToInc)) {
		return nil, newErr("connect", h.To, ErrStaleIncarnation,
			fmt.Sprintf("answered by %s/%016x, expected %s/%016x", res.ack.Name, res.ack.Inc, h.To, h.ToInc), nil)
	}
	return res, nil
}

// answerChallenge is the dialer's part of authentication: it sends its proof over the
// challenge, then checks the listener's proof (the listener checks the dialer's on its own,
// so with differing secrets both sides refuse and count).
func (a *Agent) answerChallenge(c net.Conn, addr string, h *hello, body []byte) (*challenge, error) {
	if a.cfg.Auth == nil {
		why := fmt.Sprintf("peer at %s requires authentication: this agent has no shared secret configured", addr)
		a.countAuthRefusal("dialer", h.To, addr, roleName(h.Role), why)
		return nil, newErr("connect", h.To, ErrPermission, why, nil)
	}
	var ch challenge
	if _, err := checkMsgpack(body, 2); err != nil {
		return nil, err
	}
	if err := msgpack.Unmarshal(body, &ch); err != nil || len(ch.Nonce) != authNonceBytes || ch.Name == "" || len(ch.Name) > maxNameLen {
		return nil, fmt.Errorf("%w: malformed challenge", ErrProtocol)
	}
	if h.To != "" && ch.Name != h.To {
		return nil, newErr("connect", h.To, ErrStaleIncarnation, fmt.Sprintf("challenged by %s/%016x, expected %s", ch.Name, ch.Inc, h.To), nil)
	}
	t := transcript(h, ch.Name, ch.Inc, ch.Nonce)
	proof, err := a.cfg.Auth.proof(authDialer, t)
	if err != nil {
		return nil, newErr("connect", h.To, ErrPermission, "computing the authentication proof", err)
	}
	payload, err := msgpack.Marshal(&authProof{Proof: proof})
	if err != nil {
		return nil, newErr("connect", h.To, ErrInvalidParam, "encoding the proof", err)
	}
	if _, err := c.Write(encodeFrame(wire.Header{Op: wire.OpAuth}, payload)); err != nil {
		return nil, err
	}
	if !checkProof(a.cfg.Auth, authListener, t, ch.Proof) {
		why := fmt.Sprintf("peer %s at %s failed to prove the shared secret: the secrets differ (or it is not the agent it claims)", ch.Name, addr)
		a.countAuthRefusal("dialer", ch.Name, addr, roleName(h.Role), why)
		// Read the listener's verdict on our proof (bounded by the handshake deadline) so
		// that both sides have decided, and counted, when this one reports.
		if hdr, body, fds, err := readAnswer(c); err == nil {
			for _, fd := range fds {
				unix.Close(fd)
			}
			if hdr.Op == wire.OpError {
				why += "; the peer answered: " + string(body)
			}
		}
		return nil, newErr("connect", h.To, ErrPermission, why, nil)
	}
	return &ch, nil
}

// readAnswer reads one handshake frame from the listener (collecting fds on a Unix socket).
func readAnswer(c net.Conn) (wire.Header, []byte, []int, error) {
	var hb [wire.HeaderSize]byte
	var fds []int
	var err error
	if uc, ok := c.(*net.UnixConn); ok {
		fds, err = readWithFDs(uc, hb[:])
	} else {
		_, err = io.ReadFull(c, hb[:])
	}
	closeFDs := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	if err != nil {
		closeFDs()
		return wire.Header{}, nil, nil, err
	}
	hdr, err := wire.DecodeHeader(hb[:])
	if err == nil {
		err = wire.Limits{MaxControl: maxAckBytes}.Check(hdr)
	}
	if err == nil && (hdr.Op == wire.OpChallenge || hdr.Op == wire.OpError) && hdr.Length > maxAuthBytes+maxErrorBytes {
		err = fmt.Errorf("%v of %d bytes", hdr.Op, hdr.Length)
	}
	if err != nil {
		closeFDs()
		return hdr, nil, nil, fmt.Errorf("%w: %v", ErrProtocol, err)
	}
	body, err := readPayload(c, hdr.Length)
	if err != nil {
		closeFDs()
		return hdr, nil, nil, err
	}
	return hdr, body, fds, nil
}

// readWithFDs fills buf from a Unix socket, collecting any fds passed alongside.
func readWithFDs(uc *net.UnixConn, buf []byte) ([]int, error) {
	oob := make([]byte, unix.CmsgSpace(maxFDsPerAck*4))
	var fds []int
	for got := 0; got < len(buf); {
		n, oobn, flags, _, err := uc.ReadMsgUnix(buf[got:], oob)
		if oobn > 0 {
			msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
			if perr == nil {
				for i := range msgs {
					if more, err := unix.ParseUnixRights(&msgs[i]); err == nil {
						fds = append(fds, more...)
					}
				}
			}
		}
		if flags&unix.MSG_CTRUNC != 0 && err == nil {
			err = fmt.Errorf("%w: control message truncated", ErrProtocol)
		}
		if err == nil && n == 0 {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			for _, fd := range fds {
				unix.Close(fd)
			}
			return nil, err
		}
		got += n
	}
	return fds, nil
}

// deadLinkTimeout is how long a transfer TCP connection's peer may stay silent — no ACK for
// data sent, no answer to keepalive probes — before the kernel drops the connection and every
// request on it fails. Without it a link that goes down without a reset (a cable, a host that
// vanished) holds a reader until its request's deadline: the peer's ACKs and probes stop, but the
// kernel's defaults keep retransmitting for minutes. Keepalive probes are answered by the peer's
// kernel whatever its process is doing, so a side that merely waits for data never drops a peer
// whose process is busy or stopped. The side that sends is stricter: when the peer's process
// stops reading, its receive window closes, and (Linux 5.x and later) TCP_USER_TIMEOUT also
// bounds the zero-window probes that then go without the window reopening, so a reader stopped
// or frozen for more than about deadLinkTimeout has its connection dropped and the transfer fails
// (ErrRemoteDisconnect) rather than hanging until the request's deadline.
const deadLinkTimeout = 12 * time.Second

// tuneTCP applies the socket options used on every transfer TCP connection: no Nagle delay, and
// dead-link detection within about deadLinkTimeout in both directions — keepalive probes for the
// side that waits for data (idle 5 s, then 3 probes 2 s apart) and TCP_USER_TIMEOUT for the side
// whose data goes unacknowledged or, facing a zero window, unread (see deadLinkTimeout).
func tuneTCP(c *net.TCPConn) {
	_ = c.SetNoDelay(true)
	_ = c.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3})
	if rc, err := c.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(deadLinkTimeout/time.Millisecond))
		})
	}
}

// FetchRemote fetches the metadata of the agent listening on the TCP address addr and loads
// it (see LoadRemote). It returns the peer name.
func (a *Agent) FetchRemote(ctx context.Context, addr string) (string, error) {
	blob, err := a.FetchMetadata(ctx, addr)
	if err != nil {
		return "", err
	}
	return a.LoadRemote(blob)
}

// FetchMetadata returns the metadata blob of the agent listening on the TCP address addr,
// without loading it.
func (a *Agent) FetchMetadata(ctx context.Context, addr string) ([]byte, error) {
	if a.closed.Load() {
		return nil, newErr("fetch", "", ErrClosed, "agent closed", nil)
	}
	res, err := a.dial(ctx, "tcp", addr, hello{Role: roleMeta})
	if err != nil {
		return nil, err
	}
	res.conn.Close()
	return res.ack.Meta, nil
}

// sendAck answers a hello, passing fds on a Unix socket.
func sendAck(c net.Conn, ack *helloAck, fds []int) error {
	payload, err := msgpack.Marshal(ack)
	if err != nil {
		return err
	}
	frame := encodeFrame(wire.Header{Op: wire.OpHelloAck}, payload)
	if len(fds) == 0 {
		_, err = c.Write(frame)
		return err
	}
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("%w: fds over a non-Unix connection", ErrNotSupported)
	}
	n, _, err := uc.WriteMsgUnix(frame, unix.UnixRights(fds...), nil)
	if err != nil {
		return err
	}
	if n < len(frame) {
		_, err = c.Write(frame[n:])
	}
	return err
}

// peerUID returns the uid of the process at the other end of a Unix socket.
func peerUID(uc *net.UnixConn) (uint32, error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return 0, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return 0, err
	}
	if cerr != nil {
		return 0, cerr
	}
	return cred.Uid, nil
}

// ownUID is the uid peers on the Unix socket must have.
func ownUID() uint32 { return uint32(os.Getuid()) }
