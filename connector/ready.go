package connector

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/kvbridge/kvbridge/transfer"
)

// readyTimeout bounds Ready's loopback handshake when its context has no deadline.
const readyTimeout = 2 * time.Second

// Ready reports whether the connector can serve its peers now: it is open, and its side channel
// answers a handshake — the get_meta request a peer sends, over loopback, authenticated as a
// peer's is, with the compatibility hash and engine id checked — so the listener is alive and its
// payload (the transfer agent's metadata) is served. It returns the reason when not. It is what
// an engine's readiness endpoint asks (openai Config.Ready).
func (c *Connector) Ready(ctx context.Context) error {
	if c.isClosed() {
		return fmt.Errorf("connector %s: %w", c.cfg.EngineID, transfer.ErrClosed)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, readyTimeout)
		defer cancel()
	}
	addr := c.side.addr().(*net.TCPAddr)
	host := addr.IP.String()
	if addr.IP.IsUnspecified() {
		host = "127.0.0.1" // a listener on every interface answers on loopback too
	}
	_, err := handshake(ctx, net.JoinHostPort(host, strconv.Itoa(addr.Port)), c.cfg.EngineID, c.hash, true, 1, c.clockSeconds, c.auth)
	if err != nil {
		return fmt.Errorf("connector %s: side channel: %w", c.cfg.EngineID, err)
	}
	return nil
}
