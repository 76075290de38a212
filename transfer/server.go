package transfer

import (
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/kvbridge/kvbridge/transfer/internal/wire"
)

// serveConn runs the listening side of one accepted connection: it validates the hello and
// serves the announced role until the connection ends. Nothing a peer sends can make it
// panic; every refusal is answered with an ERROR frame where the stream allows and counted.
func (a *Agent) serveConn(c net.Conn, isUnix bool) {
	if tc, ok := c.(*net.TCPConn); ok {
		tuneTCP(tc)
	}
	_ = c.SetDeadline(time.Now().Add(a.cfg.DialTimeout))
	h, ok := a.readHello(c)
	if !ok || !a.authenticate(c, h) {
		return
	}
	if msg, kind := a.checkHello(c, h, isUnix); kind != nil {
		a.refuse(kind)
		_, _ = c.Write(errorFrame(0, 0, kind, msg))
		return
	}
	if !a.acknowledge(c, h, isUnix) {
		return
	}
	_ = c.SetDeadline(time.Time{})
	switch h.Role {
	case roleControl:
		a.serveControl(c, h, isUnix)
	case roleData:
		_ = a.serveData(c, h.From)
	}
}

// readHello reads and decodes the HELLO that opens every connection; a malformed one is
// refused (answered and counted) and ok is false.
func (a *Agent) readHello(c net.Conn) (h *hello, ok bool) {
	var hb [wire.HeaderSize]byte
	hdr, err := readHeader(c, hb[:], wire.Limits{MaxControl: maxHelloBytes})
	if err != nil {
		a.refuse(ErrProtocol)
		return nil, false
	}
	if hdr.Op != wire.OpHello {
		a.refuse(ErrProtocol)
		_, _ = c.Write(errorFrame(0, 0, ErrProtocol, "expected HELLO"))
		return nil, false
	}
	body, err := readPayload(c, hdr.Length)
	if err != nil {
		return nil, false
	}
	h = new(hello)
	if _, err := checkMsgpack(body, 3); err != nil {
		a.refuse(ErrProtocol)
		_, _ = c.Write(errorFrame(0, 0, ErrProtocol, err.Error()))
		return nil, false
	}
	if err := msgpack.Unmarshal(body, h); err != nil || h.Version != 1 || h.From == "" || len(h.From) > maxNameLen {
		a.refuse(ErrProtocol)
		_, _ = c.Write(errorFrame(0, 0, ErrProtocol, "malformed hello"))
		return nil, false
	}
	return h, true
}

// acknowledge answers an accepted hello with HELLO_ACK: the metadata for a metadata fetch,
// the arena grants and fds for a Unix control or arena connection. It reports whether the
// connection goes on.
func (a *Agent) acknowledge(c net.Conn, h *hello, isUnix bool) bool {
	ack := helloAck{Name: a.name, Inc: a.inc}
	var fds []int
	switch h.Role {
	case roleMeta:
		ack.Meta = a.LocalMetadata()
	case roleControl, roleArenas:
		if isUnix {
			var err error
			ack.Grants, fds, err = a.exportArenas(h.Arenas)
			if err != nil {
				a.refuse(kindOf(err))
				_, _ = c.Write(errorFrame(0, 0, kindOf(err), err.Error()))
				return false
			}
		}
	}
	err := sendAck(c, &ack, fds)
	for _, fd := range fds {
		unix.Close(fd)
	}
	return err == nil
}

// serveControl reads an inbound control connection until it ends; while it lasts it is the
// peer's latest inbound control connection.
func (a *Agent) serveControl(c net.Conn, h *hello, isUnix bool) {
	cc := newCtrlConn(a, c, h.From, h.FromInc, isUnix)
	a.setInCtrl(h.From, cc)
	defer a.clearInCtrl(h.From, cc)
	_ = cc.readLoop()
}

// setInCtrl records cc as peer's latest inbound control connection.
func (a *Agent) setInCtrl(peer string, cc *ctrlConn) {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	a.inCtrl[peer] = cc
}

// clearInCtrl forgets cc as peer's inbound control connection unless a later one replaced it.
func (a *Agent) clearInCtrl(peer string, cc *ctrlConn) {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	if a.inCtrl[peer] == cc {
		delete(a.inCtrl, peer)
	}
}

// checkHello validates a hello for this listener; it returns a refusal kind and message.
func (a *Agent) checkHello(c net.Conn, h *hello, isUnix bool) (string, error) {
	switch h.Role {
	case roleControl, roleData, roleMeta:
	case roleArenas:
		if !isUnix {
			return "arena fds are only passed over the Unix socket", ErrNotSupported
		}
	default:
		return fmt.Sprintf("unknown role %d", h.Role), ErrProtocol
	}
	if h.Role != roleMeta || h.To != "" {
		if h.To != a.name {
			return fmt.Sprintf("this is agent %q, not %q", a.name, h.To), ErrNotFound
		}
	}
	if h.Role != roleMeta && h.ToInc != a.inc {
		return fmt.Sprintf("agent %q is incarnation %016x, not %016x", a.name, a.inc, h.ToInc), ErrStaleIncarnation
	}
	if isUnix {
		uc, ok := c.(*net.UnixConn)
		if !ok {
			return "not a Unix connection", ErrPermission
		}
		uid, err := peerUID(uc)
		if err != nil || uid != ownUID() {
			return "Unix peer runs as another user", ErrPermission
		}
	}
	return "", nil
}

// authenticate runs the listener's part of the connection authentication (see auth.go) and
// reports whether the connection may proceed; a refusal has been answered, counted and logged.
func (a *Agent) authenticate(c net.Conn, h *hello) bool {
	auth := a.cfg.Auth
	remote := c.RemoteAddr().String()
	refuse := func(kind error, why string) bool {
		if kind == ErrPermission {
			a.countAuthRefusal("listener", h.From, remote, roleName(h.Role), why)
		} else {
			a.refuse(kind)
		}
		_, _ = c.Write(errorFrame(0, 0, kind, why))
		return false
	}
	switch {
	case auth == nil && len(h.Nonce) == 0:
		return true
	case auth == nil:
		return refuse(ErrPermission, fmt.Sprintf("agent %q has no shared secret configured but the dialer %q authenticates: configure the same secret on both sides", a.name, h.From))
	case len(h.Nonce) == 0:
		return refuse(ErrPermission, fmt.Sprintf("authentication required: agent %q requires a shared secret and the dialer %q presented none", a.name, h.From))
	case len(h.Nonce) != authNonceBytes:
		return refuse(ErrProtocol, fmt.Sprintf("authentication nonce of %d bytes, want %d", len(h.Nonce), authNonceBytes))
	}
	nonce := make([]byte, authNonceBytes)
	if _, err := rand.Read(nonce); err != nil {
		return refuse(ErrBackend, "drawing a nonce failed")
	}
	t := transcript(h, a.name, a.inc, nonce)
	proof, err := auth.proof(authListener, t)
	if err != nil {
		return refuse(ErrBackend, "computing the authentication proof failed")
	}
	payload, err := msgpack.Marshal(&challenge{Name: a.name, Inc: a.inc, Nonce: nonce, Proof: proof})
	if err != nil {
		return refuse(ErrBackend, "encoding the challenge failed")
	}
	if _, err := c.Write(encodeFrame(wire.Header{Op: wire.OpChallenge}, payload)); err != nil {
		return false
	}
	var hb [wire.HeaderSize]byte
	hdr, err := readHeader(c, hb[:], wire.Limits{MaxControl: maxAuthBytes})
	if err != nil {
		// The dialer hung up or stalled instead of answering (canceled, or not a kvbridge
		// agent): it did not authenticate.
		return refuse(ErrPermission, fmt.Sprintf("the dialer %q did not answer the authentication challenge: %v", h.From, err))
	}
	if hdr.Op != wire.OpAuth {
		return refuse(ErrProtocol, "expected AUTH, got "+hdr.Op.String())
	}
	body, err := readPayload(c, hdr.Length)
	if err != nil {
		return refuse(ErrPermission, fmt.Sprintf("the dialer %q did not answer the authentication challenge: %v", h.From, err))
	}
	var ans authProof
	if _, err := checkMsgpack(body, 2); err != nil {
		return refuse(ErrProtocol, "malformed AUTH")
	}
	if err := msgpack.Unmarshal(body, &ans); err != nil {
		return refuse(ErrProtocol, "malformed AUTH")
	}
	if !checkProof(auth, authDialer, t, ans.Proof) {
		return refuse(ErrPermission, fmt.Sprintf("authentication failed: the proof of dialer %q does not match (the shared secrets differ)", h.From))
	}
	return true
}

// exportArenas returns grants and fresh fds for the wanted arena ids. Arenas without any
// peer-visible region are never exported; an arena is passed writable only if one of its
// regions grants PermWrite.
func (a *Agent) exportArenas(want []uint32) ([]arenaGrant, []int, error) {
	exs, grants, err := a.sharedArenas(want)
	if err != nil {
		return nil, nil, err
	}
	if len(exs) > maxFDsPerAck {
		return nil, nil, newErr("export", "", ErrNotSupported, fmt.Sprintf("%d arenas in one handshake (max %d)", len(exs), maxFDsPerAck), nil)
	}
	fds := make([]int, 0, len(exs))
	for i, ex := range exs {
		fd, err := ex.a.exportFD(grants[i].Writable)
		if err != nil {
			for _, f := range fds {
				unix.Close(f)
			}
			return nil, nil, err
		}
		fds = append(fds, fd)
	}
	return grants, fds, nil
}

// sharedArenas returns the wanted arenas and their grants, or ErrNotFound if one of them
// has no peer-visible region.
func (a *Agent) sharedArenas(want []uint32) ([]*arenaExport, []arenaGrant, error) {
	a.regMu.Lock()
	defer a.regMu.Unlock()
	exs := make([]*arenaExport, 0, len(want))
	grants := make([]arenaGrant, 0, len(want))
	for _, id := range want {
		ex := a.arenaByID[id]
		if ex == nil || ex.readers+ex.writers == 0 {
			return nil, nil, newErr("export", "", ErrNotFound, fmt.Sprintf("arena %d is not shared", id), nil)
		}
		exs = append(exs, ex)
		grants = append(grants, arenaGrant{ID: ex.id, Size: uint64(ex.a.Size()), Writable: ex.writers > 0})
	}
	return exs, grants, nil
}

// refuse counts a refused peer request or connection by kind.
func (a *Agent) refuse(kind error) { a.stats.refused.add(kind) }

// serveData is the target side of a TCP data connection from agent peer: it validates every
// range a peer asks for against the registered regions and their permissions (and READs
// against Config.AuthorizeRead), streams READ ranges straight from registered memory with
// vectored writes, and places WRITE payloads directly into registered memory with vectored
// reads. Refused requests are answered with an ERROR frame (the stream stays in sync);
// malformed frames end the connection.
func (a *Agent) serveData(c net.Conn, peer string) error {
	s := &dataServer{a: a, c: c, peer: peer, lim: a.dataLimits()}
	if sc, ok := c.(syscall.Conn); ok {
		s.rc, _ = sc.SyscallConn()
	}
	for {
		if err := s.serveFrame(); err != nil {
			return err
		}
	}
}

// dataServer serves one TCP data connection (serveData); its buffers are reused from frame
// to frame.
type dataServer struct {
	a    *Agent
	c    net.Conn
	rc   syscall.RawConn // for readv(2); nil if c is not a socket
	peer string
	lim  wire.Limits

	hb, ob [wire.HeaderSize]byte
	rbuf   []byte
	ranges []wire.Range
	iov    [][]byte // the registered memory of the frame's ranges
	out    net.Buffers
	scr    [][]byte
	descs  []Desc
}

// refusal is why a frame is refused: a sentinel (nil: not refused) and a detail.
type refusal struct {
	kind   error
	detail string
}

// serveFrame serves one READ or WRITE frame.
func (s *dataServer) serveFrame() error {
	h, op, tag, err := s.readFrame()
	if err != nil {
		return err
	}
	total, ref := s.check(h, op, tag)
	if op == Write {
		if err := s.receive(h, total, ref.kind != nil); err != nil {
			return err
		}
	}
	if ref.kind != nil {
		s.a.refuse(ref.kind)
		_, err := s.c.Write(errorFrame(h.Req, h.Seq, ref.kind, ref.detail))
		return err
	}
	if op == Write {
		(&wire.Header{Op: wire.OpWriteAck, Req: h.Req, Seq: h.Seq}).Encode(s.ob[:])
		_, err := s.c.Write(s.ob[:])
		return err
	}
	return s.sendRead(h, total)
}

// readFrame reads a frame's header and ranges (and a READ's tag, which aliases s.rbuf).
func (s *dataServer) readFrame() (wire.Header, Op, []byte, error) {
	h, err := readHeader(s.c, s.hb[:], s.lim)
	if err != nil {
		if isProtocol(err) {
			s.a.refuse(ErrProtocol)
		}
		return h, 0, nil, err
	}
	var op Op
	switch h.Op {
	case wire.OpReadReq:
		op = Read
	case wire.OpWriteData:
		op = Write
	default:
		s.a.refuse(ErrProtocol)
		_, _ = s.c.Write(errorFrame(h.Req, h.Seq, ErrProtocol, "unexpected "+h.Op.String()+" on a data connection"))
		return h, 0, nil, ErrProtocol
	}
	n := int(h.Count) * wire.RangeSize
	m := n
	if op == Read {
		m += int(h.Length) // the tag (bounded by lim.MaxTag)
	}
	if cap(s.rbuf) < m {
		s.rbuf = make([]byte, m)
	}
	s.rbuf = s.rbuf[:m]
	if _, err := io.ReadFull(s.c, s.rbuf); err != nil {
		return h, op, nil, err
	}
	s.ranges, err = wire.AppendRanges(s.ranges[:0], s.rbuf[:n])
	if err != nil {
		s.a.refuse(ErrProtocol)
		return h, op, nil, err
	}
	return h, op, s.rbuf[n:], nil
}

// check validates every range of the frame before any memory is touched, and asks
// Config.AuthorizeRead about a READ. It fills s.iov and returns the frame's byte count.
func (s *dataServer) check(h wire.Header, op Op, tag []byte) (uint64, refusal) {
	t := s.a.regions.Load()
	s.iov = s.iov[:0]
	var total uint64
	for i, r := range s.ranges {
		b, d, k := t.lookupRange(r.Region, r.Offset, r.Length, op)
		if k != nil {
			return total, refusal{k, fmt.Sprintf("range %d: %s", i, d)}
		}
		s.iov = append(s.iov, b)
		total += r.Length
	}
	switch {
	case total > s.lim.MaxPayload:
		return total, refusal{ErrInvalidDescriptor, fmt.Sprintf("%d bytes in one frame exceed %d", total, s.lim.MaxPayload)}
	case op == Write && total != h.Length:
		return total, refusal{ErrInvalidDescriptor, fmt.Sprintf("payload of %d bytes for ranges of %d bytes", h.Length, total)}
	case op == Read && s.a.cfg.AuthorizeRead != nil:
		return total, s.authorize(h, tag)
	case op == Write && s.a.cfg.AuthorizeWrite != nil:
		return total, s.authorizeWrite(h)
	}
	return total, refusal{}
}

// authorize asks Config.AuthorizeRead about a READ frame's ranges.
func (s *dataServer) authorize(h wire.Header, tag []byte) refusal {
	s.descs = s.descs[:0]
	for _, r := range s.ranges {
		s.descs = append(s.descs, Desc{Region: r.Region, Offset: int64(r.Offset), Length: int64(r.Length)})
	}
	err := s.a.authorizeRead(s.peer, tag, s.descs)
	if err == nil {
		return refusal{}
	}
	s.a.stats.readsDenied.Add(1)
	s.a.log.Warn("transfer READ refused", "peer", s.peer, "transfer_request", h.Req, "stripe", h.Seq, "err", err.Error())
	return refusal{ErrPermission, "read not authorized: " + err.Error()}
}

// authorizeWrite asks Config.AuthorizeWrite about a WRITE frame's ranges.
func (s *dataServer) authorizeWrite(h wire.Header) refusal {
	s.descs = s.descs[:0]
	for _, r := range s.ranges {
		s.descs = append(s.descs, Desc{Region: r.Region, Offset: int64(r.Offset), Length: int64(r.Length)})
	}
	err := s.a.callAuthorizer("AuthorizeWrite", s.peer, func() error { return s.a.cfg.AuthorizeWrite(s.peer, s.descs) })
	if err == nil {
		return refusal{}
	}
	s.a.stats.writesDenied.Add(1)
	s.a.log.Warn("transfer WRITE refused", "peer", s.peer, "transfer_request", h.Req, "stripe", h.Seq, "err", err.Error())
	return refusal{ErrPermission, "write not authorized: " + err.Error()}
}

// receive reads a WRITE frame's payload into registered memory, or drops it when the frame
// is refused (the stream stays in sync).
func (s *dataServer) receive(h wire.Header, total uint64, refused bool) error {
	if refused {
		return discard(s.c, h.Length)
	}
	s.scr = append(s.scr[:0], s.iov...)
	if err := readvFull(s.c, s.rc, s.scr); err != nil {
		return err
	}
	s.a.stats.servedWrite.Add(int64(total))
	return nil
}

// sendRead answers a READ frame with its ranges, written from registered memory.
func (s *dataServer) sendRead(h wire.Header, total uint64) error {
	(&wire.Header{Op: wire.OpReadData, Req: h.Req, Seq: h.Seq, Length: total}).Encode(s.ob[:])
	s.out = append(s.out[:0], s.ob[:])
	s.out = append(s.out, s.iov...)
	bufs := s.out
	if _, err := bufs.WriteTo(s.c); err != nil {
		return err
	}
	s.a.stats.servedRead.Add(int64(total))
	return nil
}

// authorizeRead calls Config.AuthorizeRead; a panic in it refuses the read.
func (a *Agent) authorizeRead(peer string, tag []byte, descs []Desc) error {
	return a.callAuthorizer("AuthorizeRead", peer, func() error { return a.cfg.AuthorizeRead(peer, tag, descs) })
}

// callAuthorizer runs the hook name; a panic in it refuses the frame.
func (a *Agent) callAuthorizer(name, peer string, f func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			a.log.Error("transfer "+name+" panicked", "peer", peer, "panic", fmt.Sprint(p))
			err = fmt.Errorf("authorization failed")
		}
	}()
	return f()
}

// isProtocol reports whether err is a protocol violation.
func isProtocol(err error) bool { return err != nil && kindOf(err) == ErrProtocol }

// discard reads and drops n bytes.
func discard(r io.Reader, n uint64) error {
	_, err := io.CopyN(io.Discard, r, int64(n))
	return err
}

// readvFull fills every buffer in iov from c, using readv(2) on the raw socket when
// available (one system call for many scattered destinations). iov is consumed.
func readvFull(c net.Conn, rc syscall.RawConn, iov [][]byte) error {
	if rc == nil {
		for _, b := range iov {
			if _, err := io.ReadFull(c, b); err != nil {
				return err
			}
		}
		return nil
	}
	for len(iov) > 0 {
		if len(iov[0]) == 0 {
			iov = iov[1:]
			continue
		}
		lim := iov
		if len(lim) > 1024 {
			lim = lim[:1024]
		}
		var n int
		var rerr error
		err := rc.Read(func(fd uintptr) bool {
			n, rerr = unix.Readv(int(fd), lim)
			return rerr != unix.EAGAIN
		})
		if err != nil {
			return err
		}
		if rerr == unix.EINTR {
			continue
		}
		if rerr != nil {
			return rerr
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
		for n > 0 {
			if n >= len(iov[0]) {
				n -= len(iov[0])
				iov = iov[1:]
			} else {
				iov[0] = iov[0][n:]
				n = 0
			}
		}
	}
	return nil
}
