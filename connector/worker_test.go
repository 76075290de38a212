package connector

import (
	"net"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/internal/kvlease"
)

// TestDeclineDuringClose: Decline (called from HTTP handlers, which may still run while the
// connector closes) racing Close. Each notification goroutine it starts is counted in the
// connector's WaitGroup before c.mu shows the connector open, so Close either waits for it or
// it is never started: under -race an Add after the unlock is reported against Close's Wait.
func TestDeclineDuringClose(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close() // nobody listens: each notification's handshake fails at once
	p := &Params{DoRemotePrefill: true, RemoteBlockIDs: [][]int32{{1}}, RemoteEngineID: "P", RemoteRequestID: "p1",
		RemoteHost: "127.0.0.1", RemotePort: port, BlockGenerations: []uint64{1}, Instance: "i", Lease: kvlease.Token{1}, HasLease: true, LeaseSlot: 0}
	raw := viaJSON(t, p.Map())
	for range 20 {
		c := startProducer(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`, nil)
		started, done := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(done)
			close(started)
			for range 20 {
				c.Decline(raw)
			}
		}()
		<-started
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatal("Decline did not return after Close")
		}
	}
}
