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
	var hb [wire.HeaderSize]byte
	hdr, err := readHeader(c, hb[:], wire.Limits{MaxControl: maxHelloBytes})
	if err != nil {
		a.refuse(ErrProtocol)
		return
	}
	if hdr.Op != wire.OpHello {
		a.refuse(ErrProtocol)
		_, _ = c.Write(errorFrame(0, 0, ErrProtocol, "expected HELLO"))
		return
	}
	body, err := readPayload(c, hdr.Length)
	if err != nil {
		return
	}
	var h hello
	if _, err := checkMsgpack(body, 3); err != nil {
		a.refuse(ErrProtocol)
		_, _ = c.Write(errorFrame(0, 0, ErrProtocol, err.Error()))
		return
	}
	if err := msgpack.Unmarshal(body, &h); err != nil || h.Version != 1 || h.From == "" || len(h.From) > maxNameLen {
		a.refuse(ErrProtocol)
		_, _ = c.Write(errorFrame(0, 0, ErrProtocol, "malformed hello"))
		return
	}
	if !a.authenticate(c, &h) {
		return
	}
	if msg, kind := a.checkHello(c, &h, isUnix); kind != nil {
		a.refuse(kind)
		_, _ = c.Write(errorFrame(0, 0, kind, msg))
		return
	}
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
				return
			}
		}
	}
	err = sendAck(c, &ack, fds)
	for _, fd := range fds {
		unix.Close(fd)
	}
	if err != nil {
		return
	}
	_ = c.SetDeadline(time.Time{})
	switch h.Role {
	case roleControl:
		cc := newCtrlConn(a, c, h.From, h.FromInc, isUnix)
		a.connMu.Lock()
		a.inCtrl[h.From] = cc
		a.connMu.Unlock()
		_ = cc.readLoop()
		a.connMu.Lock()
		if a.inCtrl[h.From] == cc {
			delete(a.inCtrl, h.From)
		}
		a.connMu.Unlock()
	case roleData:
		_ = a.serveData(c, h.From)
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
	proof, err := auth.Proof(AuthListener, t)
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
	if !checkProof(auth, AuthDialer, t, ans.Proof) {
		return refuse(ErrPermission, fmt.Sprintf("authentication failed: the proof of dialer %q does not match (the shared secrets differ)", h.From))
	}
	return true
}

// exportArenas returns grants and fresh fds for the wanted arena ids. Arenas without any peer-visible region are never exported; an arena is
// passed writable only if one of its regions grants PermWrite.
func (a *Agent) exportArenas(want []uint32) ([]arenaGrant, []int, error) {
	a.regMu.Lock()
	var exs []*arenaExport
	for _, id := range want {
		ex := a.arenaByID[id]
		if ex == nil || ex.readers+ex.writers == 0 {
			a.regMu.Unlock()
			return nil, nil, newErr("export", "", ErrNotFound, fmt.Sprintf("arena %d is not shared", id), nil)
		}
		exs = append(exs, ex)
	}
	grants := make([]arenaGrant, 0, len(exs))
	writable := make([]bool, 0, len(exs))
	for _, ex := range exs {
		grants = append(grants, arenaGrant{ID: ex.id, Size: uint64(ex.a.Size()), Writable: ex.writers > 0})
		writable = append(writable, ex.writers > 0)
	}
	a.regMu.Unlock()
	if len(exs) > maxFDsPerAck {
		return nil, nil, newErr("export", "", ErrNotSupported, fmt.Sprintf("%d arenas in one handshake (max %d)", len(exs), maxFDsPerAck), nil)
	}
	fds := make([]int, 0, len(exs))
	for i, ex := range exs {
		fd, err := ex.a.exportFD(writable[i])
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

// refuse counts a refused peer request or connection by kind.
func (a *Agent) refuse(kind error) { a.stats.refused.add(kind) }

// serveData is the target side of a TCP data connection from agent peer: it validates every
// range a peer asks for against the registered regions and their permissions (and READs
// against Config.AuthorizeRead), streams READ ranges straight from registered memory with
// vectored writes, and places WRITE payloads directly into registered memory with vectored
// reads. Refused requests are answered with an ERROR frame (the stream stays in sync);
// malformed frames end the connection.
func (a *Agent) serveData(c net.Conn, peer string) error {
	lim := a.dataLimits()
	var hb, ob [wire.HeaderSize]byte
	var rc syscall.RawConn
	if sc, ok := c.(syscall.Conn); ok {
		rc, _ = sc.SyscallConn()
	}
	var (
		rbuf   []byte
		ranges []wire.Range
		iov    [][]byte
		out    net.Buffers
		scr    [][]byte
		descs  []Desc
	)
	for {
		h, err := readHeader(c, hb[:], lim)
		if err != nil {
			if isProtocol(err) {
				a.refuse(ErrProtocol)
			}
			return err
		}
		var op Op
		switch h.Op {
		case wire.OpReadReq:
			op = Read
		case wire.OpWriteData:
			op = Write
		default:
			a.refuse(ErrProtocol)
			_, _ = c.Write(errorFrame(h.Req, h.Seq, ErrProtocol, "unexpected "+h.Op.String()+" on a data connection"))
			return ErrProtocol
		}
		n := int(h.Count) * wire.RangeSize
		m := n
		if op == Read {
			m += int(h.Length) // the tag (bounded by lim.MaxTag)
		}
		if cap(rbuf) < m {
			rbuf = make([]byte, m)
		}
		rbuf = rbuf[:m]
		if _, err := io.ReadFull(c, rbuf); err != nil {
			return err
		}
		tag := rbuf[n:]
		ranges, err = wire.AppendRanges(ranges[:0], rbuf[:n])
		if err != nil {
			a.refuse(ErrProtocol)
			return err
		}
		// Validate every range before touching memory.
		t := a.regions.Load()
		iov = iov[:0]
		var total uint64
		var kind error
		var detail string
		for i, r := range ranges {
			b, d, k := t.lookupRange(r.Region, r.Offset, r.Length, op)
			if k != nil {
				kind, detail = k, fmt.Sprintf("range %d: %s", i, d)
				break
			}
			iov = append(iov, b)
			total += r.Length
		}
		if kind == nil && total > lim.MaxPayload {
			kind, detail = ErrInvalidDescriptor, fmt.Sprintf("%d bytes in one frame exceed %d", total, lim.MaxPayload)
		}
		if kind == nil && op == Write && total != h.Length {
			kind, detail = ErrInvalidDescriptor, fmt.Sprintf("payload of %d bytes for ranges of %d bytes", h.Length, total)
		}
		if kind == nil && op == Read && a.cfg.AuthorizeRead != nil {
			descs = descs[:0]
			for _, r := range ranges {
				descs = append(descs, Desc{Region: r.Region, Offset: int64(r.Offset), Length: int64(r.Length)})
			}
			if err := a.authorizeRead(peer, tag, descs); err != nil {
				kind, detail = ErrPermission, "read not authorized: "+err.Error()
				a.stats.readsDenied.Add(1)
				a.log.Warn("transfer READ refused", "peer", peer, "transfer_request", h.Req, "stripe", h.Seq, "err", err.Error())
			}
		}
		if op == Write {
			if kind != nil {
				if err := discard(c, h.Length); err != nil {
					return err
				}
			} else {
				scr = append(scr[:0], iov...)
				if err := readvFull(c, rc, scr); err != nil {
					return err
				}
				a.stats.servedWrite.Add(int64(total))
			}
		}
		if kind != nil {
			a.refuse(kind)
			if _, err := c.Write(errorFrame(h.Req, h.Seq, kind, detail)); err != nil {
				return err
			}
			continue
		}
		if op == Write {
			(&wire.Header{Op: wire.OpWriteAck, Req: h.Req, Seq: h.Seq}).Encode(ob[:])
			if _, err := c.Write(ob[:]); err != nil {
				return err
			}
			continue
		}
		(&wire.Header{Op: wire.OpReadData, Req: h.Req, Seq: h.Seq, Length: total}).Encode(ob[:])
		out = append(out[:0], ob[:])
		out = append(out, iov...)
		bufs := out
		if _, err := bufs.WriteTo(c); err != nil {
			return err
		}
		a.stats.servedRead.Add(int64(total))
	}
}

// authorizeRead calls Config.AuthorizeRead; a panic in it refuses the read.
func (a *Agent) authorizeRead(peer string, tag []byte, descs []Desc) (err error) {
	defer func() {
		if p := recover(); p != nil {
			a.log.Error("transfer AuthorizeRead panicked", "peer", peer, "panic", fmt.Sprint(p))
			err = fmt.Errorf("authorization failed")
		}
	}()
	return a.cfg.AuthorizeRead(peer, tag, descs)
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
