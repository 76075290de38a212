package transfer

import (
	"net"
	"testing"
	"time"
)

// TestRefusalThenDeadlineAbortsBusyStripe: after the peer refused one stripe (ErrPermission),
// the stripes still reading their payload run on; if the peer then stalls, the request's
// deadline must still close their connections so that Done closes (the first error is the one
// reported).
//
// The target's AuthorizeRead holds both READ frames, so each stripe is known to be sent; the
// test then plays the initiator's reader: stripe 0 starts reading its payload (busy) and the
// refusal of stripe 1 arrives. Nothing more comes from the peer.
func TestRefusalThenDeadlineAbortsBusyStripe(t *testing.T) {
	seen := make(chan struct{}, 8)
	release := make(chan struct{})
	authorize := func(string, []byte, []Desc) error {
		seen <- struct{}{}
		<-release
		return nil
	}
	p := newPair(t, Config{AuthorizeRead: authorize}, Config{StripeBytes: 4096, TCPStreams: 2}, 1<<16, PermRead)
	t.Cleanup(func() { close(release) }) // before the agents close
	ll, rl := p.lists(t, 4096, &PrepareOptions{Backends: []string{"TCP"}})
	req, err := p.ini.MakeRequest(Read, ll, seq(2), rl, seq(2), &RequestOptions{Timeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer req.Release()
	if len(req.stripes) != 2 {
		t.Fatalf("%d stripes, want 2", len(req.stripes))
	}
	ctx := testCtx(t)
	if err := req.Post(ctx, nil); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		select {
		case <-seen:
		case <-ctx.Done():
			t.Fatal("the target did not receive both READ frames")
		}
	}
	gen := req.currentGen()
	s0 := &req.stripes[0]
	if !s0.startRead(gen) {
		t.Fatal("stripe 0 is not awaiting its payload")
	}
	c0 := func() *dataConn {
		s0.mu.Lock()
		defer s0.mu.Unlock()
		return s0.conn
	}()
	req.fail(gen, ErrPermission, "refused by the peer: test", nil)
	if c0.ctx.Err() != nil {
		t.Fatal("a refusal closed the connection of a stripe reading its payload")
	}
	// The deadline passes now: the test moves it and fires the request's timer, rather than
	// giving the request a short timeout, which a loaded machine could reach before the
	// refusal (the first error would then be the timeout, not the refusal).
	func() {
		req.mu.Lock()
		defer req.mu.Unlock()
		req.deadline = time.Now()
		req.timer.Reset(0)
	}()
	select {
	case <-c0.ctx.Done(): // the deadline aborted the busy stripe's connection
	case <-ctx.Done():
		t.Fatal("the request's deadline did not abort the stripe left reading after a refusal")
	}
	s0.finishRead(gen, net.ErrClosed) // what the reader does when its connection closes
	select {
	case <-req.Done():
	case <-ctx.Done():
		t.Fatal("Done did not close")
	}
	wantKind(t, req.Err(), ErrPermission)
}
