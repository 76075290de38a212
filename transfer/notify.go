package transfer

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/transfer/internal/wire"
)

// Notif is a notification received from a peer: a message attached to a completed request
// or sent with SendNotif. Messages from one peer arrive in the order that peer sent them.
type Notif struct {
	Peer        string // sending agent's name
	Incarnation uint64 // sending agent's incarnation
	Seq         uint64 // per-connection sequence number assigned by the sender (from 1)
	Msg         []byte
}

// Notifications returns the channel on which received notifications are delivered. It is
// closed by Close. When nobody drains it and it fills up, the oldest message is dropped and
// counted in Stats.NotifsDropped, so a slow consumer never stalls a connection.
func (a *Agent) Notifications() <-chan Notif { return a.notifs }

// DrainNotifs appends every queued notification to dst without blocking and returns it.
func (a *Agent) DrainNotifs(dst []Notif) []Notif {
	for {
		select {
		case n, ok := <-a.notifs:
			if !ok {
				return dst
			}
			dst = append(dst, n)
		default:
			return dst
		}
	}
}

// deliver queues a notification, dropping the oldest one when the queue is full.
func (a *Agent) deliver(n Notif) {
	a.notifMu.Lock()
	defer a.notifMu.Unlock()
	for {
		select {
		case a.notifs <- n:
			a.stats.notifsReceived.Add(1)
			return
		default:
		}
		select {
		case <-a.notifs:
			a.stats.notifsDropped.Add(1)
		default:
		}
	}
}

// SendNotif sends msg to peer. It travels on the peer's notification route (a UCX link when
// one is up, else the Unix socket when SHM is up, else TCP), after any request notification
// sent before it, so one peer receives an agent's messages in order. peer is either an agent
// whose metadata was loaded (a connection is made if needed) or one currently connected to
// this agent.
func (a *Agent) SendNotif(ctx context.Context, peer string, msg []byte) error {
	if a.closed.Load() {
		return newErr("notify", peer, ErrClosed, "agent closed", nil)
	}
	if len(msg) > a.cfg.MaxNotifBytes {
		return newErr("notify", peer, ErrInvalidParam, "message larger than MaxNotifBytes", nil)
	}
	deadline := time.Now().Add(a.cfg.RequestTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if p := a.lookupPeer(peer); p != nil {
		rt, err := p.route(ctx, 0)
		if err != nil {
			return err
		}
		if err := rt.send(msg, deadline); err != nil {
			if cc, ok := rt.(*ctrlConn); ok {
				p.teardownConn(cc, nil, "sending notification failed")
			} // a UCX link tears itself down when a send fails
			return newErr("notify", peer, ErrRemoteDisconnect, "", err)
		}
		return nil
	}
	cc := a.inboundCtrl(peer)
	if cc == nil {
		if a.ucx != nil {
			if ok, err := a.ucx.sendInbound(ctx, peer, msg, deadline); ok {
				if err != nil {
					return newErr("notify", peer, ErrRemoteDisconnect, "", err)
				}
				return nil
			}
		}
		return newErr("notify", peer, ErrNotFound, "no metadata loaded and no connection from this peer", nil)
	}
	if err := cc.send(msg, deadline); err != nil {
		cc.close()
		return newErr("notify", peer, ErrRemoteDisconnect, "", err)
	}
	return nil
}

// ctrlConn is a control connection (either direction): it carries notifications and its
// end tells the other side that this agent is gone.
type ctrlConn struct {
	a       *Agent
	c       net.Conn
	peer    string
	peerInc uint64
	unix    bool

	wmu sync.Mutex
	// guarded by wmu: one frame is written at a time.
	seq  uint64
	wbuf []byte

	closeOnce sync.Once
}

// newCtrlConn wraps an established, handshaken connection.
func newCtrlConn(a *Agent, c net.Conn, peer string, peerInc uint64, isUnix bool) *ctrlConn {
	return &ctrlConn{a: a, c: c, peer: peer, peerInc: peerInc, unix: isUnix}
}

// send writes one notification frame, bounded by deadline. Frames are written whole under
// the lock, so concurrent senders never interleave and per-connection order is kept.
func (cc *ctrlConn) send(msg []byte, deadline time.Time) error {
	cc.wmu.Lock()
	defer cc.wmu.Unlock()
	cc.seq++
	n := wire.HeaderSize + len(msg)
	if cap(cc.wbuf) < n {
		cc.wbuf = make([]byte, n)
	}
	b := cc.wbuf[:n]
	(&wire.Header{Op: wire.OpNotif, Req: cc.seq, Length: uint64(len(msg))}).Encode(b)
	copy(b[wire.HeaderSize:], msg)
	_ = cc.c.SetWriteDeadline(deadline)
	_, err := cc.c.Write(b)
	if err == nil {
		cc.a.stats.notifsSent.Add(1)
	}
	return err
}

// readLoop delivers incoming notifications until the connection fails; any other frame is a
// protocol violation that ends the connection.
func (cc *ctrlConn) readLoop() error {
	lim := cc.a.dataLimits()
	var hb [wire.HeaderSize]byte
	for {
		h, err := readHeader(cc.c, hb[:], lim)
		if err != nil {
			if isProtocol(err) {
				cc.a.refuse(ErrProtocol)
			}
			return err
		}
		if h.Op != wire.OpNotif {
			cc.a.refuse(ErrProtocol)
			return ErrProtocol
		}
		msg, err := readPayload(cc.c, h.Length)
		if err != nil {
			return err
		}
		cc.a.deliver(Notif{Peer: cc.peer, Incarnation: cc.peerInc, Seq: h.Req, Msg: msg})
	}
}

// close closes the connection (idempotent).
func (cc *ctrlConn) close() {
	cc.closeOnce.Do(func() { cc.c.Close() })
}

// inboundCtrl returns peer's latest inbound control connection, or nil.
func (a *Agent) inboundCtrl(peer string) *ctrlConn {
	a.connMu.Lock()
	defer a.connMu.Unlock()
	return a.inCtrl[peer]
}
