//go:build ucx && cgo

package transfer

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// ucxTransports are the UCX transports the cross-process tests run over: TCP on loopback,
// and the shared-memory family, which in this container is sysv and posix (UCX's cma has no
// peer-failure support in UCX 1.13, so endpoints with error handling leave it out; see
// TestUCXLanes). UCX_TLS reaches the peer process through its environment and the
// initiator through Config.UCX.
var ucxTransports = []string{"tcp", "sm"}

// ucxConfig is an agent configuration with UCX forced over tls.
func ucxConfig(tls string) Config {
	return Config{Backends: []string{"UCX"}, UCX: map[string]string{"TLS": tls}}
}

// startUCXPeer starts a peer process that offers UCX only, over tls.
func startUCXPeer(t *testing.T, name string, seed uint64, size int64, tls string) *testPeer {
	t.Helper()
	return startTestPeer(t, name, seed, size, "UCX_TLS="+tls, envPeerBE+"=UCX")
}

// TestUCXCrossProcess: READ and WRITE against a peer process over UCX, checksum of every
// block, notifications in both directions (the peer answers over the route the initiator's
// hello gave it, without loading the initiator's metadata), on each transport.
func TestUCXCrossProcess(t *testing.T) {
	for _, tls := range ucxTransports {
		t.Run(tls, func(t *testing.T) {
			const size = 8 << 20
			peer := startUCXPeer(t, "xpeer", 0x33, size, tls)
			cfg := ucxConfig(tls)
			cfg.UCXWorkers = 3 // large requests spread over three endpoints to the peer's one worker
			x := newCrossProcess(t, peer, cfg, size)
			x.readWrite(t, "UCX", 101)
			x.readWrite(t, "UCX", 102) // the second round reuses the link
			info, _ := x.ini.Peer(x.name)
			if len(info.UCXLanes) == 0 {
				t.Fatalf("no UCX lanes reported: %+v", info)
			}
			t.Logf("UCX_TLS=%s lanes: %q", tls, info.UCXLanes)
			if st := x.ini.Stats(); st.Connects != 1 || st.RequestsFailed != 0 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// TestUCXPeerKilledAfterLoad: the peer dies after its metadata was loaded; preparing (which
// connects) fails with ErrRemoteDisconnect.
func TestUCXPeerKilledAfterLoad(t *testing.T) {
	for _, tls := range ucxTransports {
		t.Run(tls, func(t *testing.T) {
			peer := startUCXPeer(t, "xdead", 1, 1<<20, tls)
			ini := newTestAgent(t, "xinit", ucxConfig(tls))
			name, err := ini.LoadRemote(peer.meta)
			if err != nil {
				t.Fatal(err)
			}
			peer.kill()
			_, err = ini.PrepareRemote(testCtx(t), name, BlockDescs(1, 0, 4096, 4), nil)
			wantKind(t, err, ErrRemoteDisconnect)
		})
	}
}

// TestUCXPeerKilledMidTransfer: a READ is in flight to a stopped peer (UCX emulates the get
// with messages the peer must answer) that is then killed: the READ fails with
// ErrRemoteDisconnect, not a timeout, and a later post fails promptly.
func TestUCXPeerKilledMidTransfer(t *testing.T) {
	for _, tls := range ucxTransports {
		t.Run(tls, func(t *testing.T) {
			peer := startUCXPeer(t, "xmid", 7, 8<<20, tls)
			ini, _, req := peerRead(t, peer, ucxConfig(tls), 8<<20, time.Minute)
			ctx := testCtx(t)
			peer.stop()
			if err := req.Post(ctx, []byte("x")); err != nil {
				t.Fatal(err)
			}
			if st, _ := req.status(); st != statusInProgress {
				t.Fatalf("status %v while the peer is stopped", st)
			}
			peer.kill()
			wantKind(t, req.Wait(ctx), ErrRemoteDisconnect)
			wantKind(t, postWait(t, req, nil), ErrRemoteDisconnect)
			if f := ini.Stats().Failures; f.RemoteDisconnect != 2 || f.Timeout != 0 {
				t.Fatalf("failures %+v", f)
			}
		})
	}
}

// TestUCXPeerRestart: the peer restarts with a new incarnation. The old request fails (first
// as disconnected, then, once the new metadata is loaded, as stale); a new one reads the new
// incarnation's bytes.
func TestUCXPeerRestart(t *testing.T) {
	for _, tls := range ucxTransports {
		t.Run(tls, func(t *testing.T) {
			const size, block = 4 << 20, 1 << 20
			p1 := startUCXPeer(t, "xrestart", 11, size, tls)
			ini := newTestAgent(t, "xinit", ucxConfig(tls))
			ar := newTestArena(t, size)
			reg := mustRegister(t, ini, ar, 0)
			if _, err := ini.LoadRemote(p1.meta); err != nil {
				t.Fatal(err)
			}
			read := func() *Request {
				r, err := ini.CreateRequest(testCtx(t), Read, BlockDescs(reg.ID(), 0, block, 4), "xrestart", BlockDescs(1, 0, block, 4), nil)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(r.Release)
				if err := postWait(t, r, nil); err != nil {
					t.Fatal(err)
				}
				return r
			}
			old := read()
			p1.kill()
			wantKind(t, postWait(t, old, []byte("n")), ErrRemoteDisconnect)
			p2 := startUCXPeer(t, "xrestart", 22, size, tls)
			if _, err := ini.LoadRemote(p2.meta); err != nil {
				t.Fatal(err)
			}
			wantKind(t, postWait(t, old, nil), ErrStaleIncarnation)
			clear(ar.Bytes())
			read()
			want, got := expectedSums(size, 22, block), blockSums(ar.Bytes(), block)
			for i := range got {
				if got[i] != want[i] {
					t.Fatalf("block %d is not the new incarnation's", i)
				}
			}
		})
	}
}

// TestUCXStalledPeerTimeout: a stopped peer makes a READ end in ErrTimeout (the link is torn
// down so that nothing can land in local memory afterwards); once the peer runs again the
// same request succeeds over a new link.
func TestUCXStalledPeerTimeout(t *testing.T) {
	for _, tls := range ucxTransports {
		t.Run(tls, func(t *testing.T) {
			peer := startUCXPeer(t, "xstall", 5, 4<<20, tls)
			ini := stalledPeerTimeout(t, peer, ucxConfig(tls))
			if st := ini.Stats(); st.Connects != 2 {
				t.Fatalf("%d connects, want 2 (the timeout closes the link)", st.Connects)
			}
		})
	}
}

// TestUCXNotifOrder: notifications to one peer arrive in the order they were sent, whether
// attached to requests or sent alone (and the peer's echoes come back in order).
func TestUCXNotifOrder(t *testing.T) {
	for _, tls := range ucxTransports {
		t.Run(tls, func(t *testing.T) {
			const size = 1 << 20
			peer := startUCXPeer(t, "xorder", 9, size, tls)
			x := newCrossProcess(t, peer, ucxConfig(tls), size)
			rl, err := x.ini.PrepareRemote(testCtx(t), x.name, BlockDescs(1, 0, x.block, x.n), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer rl.Release()
			req, err := x.ini.MakeRequest(Write, x.ll, seq(x.n), rl, seq(x.n), nil)
			if err != nil {
				t.Fatal(err)
			}
			defer req.Release()
			const rounds = 50
			for i := range rounds {
				if i%2 == 0 {
					if err := postWait(t, req, fmt.Appendf(nil, "%d", i)); err != nil {
						t.Fatal(err)
					}
				} else if err := x.ini.SendNotif(testCtx(t), x.name, fmt.Appendf(nil, "%d", i)); err != nil {
					t.Fatal(err)
				}
			}
			for i := range rounds {
				if nt := recvNotif(t, x.ini); string(nt.Msg) != fmt.Sprintf("ECHO:%d", i) {
					t.Fatalf("echo %d: %q", i, nt.Msg)
				}
			}
		})
	}
}

// TestUCXInitiatorKilledMidTransfer: a peer process READing from this agent in a loop is
// killed; this agent (the target, answering the emulated gets) should keep running and serve
// the next initiator. With UCX 1.13 it does not reliably: over TCP, UCX sometimes aborts the
// target (ucp_get_req_handler answers a get whose reader is gone: "Fatal: unexpected error:
// Endpoint timeout"), and over shared memory its worker can spin on the dead reader's full
// queue and stop answering. Both are inside UCX's emulation of gets with active messages,
// which RDMA transports do not use; the test reproduces them on demand
// (KVBRIDGE_UCX_REPRO=1) and stays out of the suite until kvbridge emulates gets itself.
func TestUCXInitiatorKilledMidTransfer(t *testing.T) {
	if os.Getenv("KVBRIDGE_UCX_REPRO") == "" {
		t.Skip("reproduces a UCX 1.13 fault; set KVBRIDGE_UCX_REPRO=1 to run it")
	}
	for _, tls := range ucxTransports {
		t.Run(tls, func(t *testing.T) {
			const size = 8 << 20
			tgt := newTestAgent(t, "xtarget", ucxConfig(tls))
			ar := newTestArena(t, size)
			fillPattern(ar.Bytes(), 0x44)
			mustRegister(t, tgt, ar, PermRead)
			reader := startUCXPeer(t, "xreader", 1, size, tls)
			if got := reader.call("pull " + base64.StdEncoding.EncodeToString(tgt.LocalMetadata())); got != "PULLING" {
				t.Fatalf("reader said %q", got)
			}
			reader.kill()
			peer := &testPeer{meta: tgt.LocalMetadata()}
			_, local, req := peerRead(t, peer, ucxConfig(tls), size, time.Minute)
			if err := postWait(t, req, nil); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(local.Bytes(), ar.Bytes()) {
				t.Fatal("READ after the killed reader brought other bytes")
			}
			if st := tgt.Stats(); st.Refused.Total() != 0 {
				t.Fatalf("target refused %+v", st.Refused)
			}
		})
	}
}

// TestUCXStalledPeerNotif: after a READ timed out against a stopped peer (which tears the link
// down), a notification sent alone once the peer runs again reaches it over a new link, and
// the peer's echo comes back, whether or not the peer had an answer route open before the
// stall. Cold, UCX 1.13 used to join the peer's new answer route to this agent's first
// link's endpoint, closed by the timeout (see ucxEngine), so that the route's hello, and
// then the echo, went nowhere.
func TestUCXStalledPeerNotif(t *testing.T) {
	for _, tls := range ucxTransports {
		for _, warm := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/warm=%v", tls, warm), func(t *testing.T) {
				peer := startUCXPeer(t, "xstallnotif", 5, 4<<20, tls)
				ini := stalledPeerNotif(t, peer, ucxConfig(tls), warm)
				if st := ini.Stats(); st.Connects != 2 {
					t.Fatalf("%d connects, want 2 (the timeout closes the link)", st.Connects)
				}
			})
		}
	}
}

// TestUCXStalledPeerOwnLink: the peer notifies this agent over a UCX link of its own (it
// loaded this agent's metadata), opened before (warm) or after (cold) a READ timed out against
// the stopped peer and closed this agent's link. UCX 1.13 joins each side's k-th endpoint to
// the other's worker into one connection (see ucxEngine), so the peer's link rides an
// endpoint of this agent's closed link; the answer worker does not help here, both ends being
// link workers. What UCX 1.13 then does varies from run to run; kvbridge reports what it
// loses rather than losing it silently (seen so far):
//   - cold, connecting the peer's link fails with ErrRemoteDisconnect: its hello, sent with a
//     reply endpoint for the acknowledgement, is dropped with the closed endpoint ("did not
//     acknowledge the UCX hello" after DialTimeout), or UCX reports "Connection reset by
//     remote peer" (TCP) or does not complete the wire-up within DialTimeout (shared memory);
//     over TCP the next notification, on an endpoint UCX pairs with nothing stale, arrives;
//   - warm over TCP, the notifications arrive (UCX hands an active message sent without a
//     reply endpoint to the worker, whatever became of the endpoint);
//   - warm over shared memory, the notification sometimes arrives and sometimes stays pending
//     in UCX until its deadline tears the link down and SendNotif fails;
//   - over shared memory, once one has failed, the peer's next links often do not complete
//     their wire-up within DialTimeout either, for as long as the test runs.
//
// Each notification must arrive or its SendNotif fail. The test takes tens of seconds (the
// timeouts above) and documents UCX's behaviour; it runs on demand (KVBRIDGE_UCX_REPRO=1).
func TestUCXStalledPeerOwnLink(t *testing.T) {
	if os.Getenv("KVBRIDGE_UCX_REPRO") == "" {
		t.Skip("documents UCX 1.13's joining of endpoints; set KVBRIDGE_UCX_REPRO=1 to run it")
	}
	for _, tls := range ucxTransports {
		for _, warm := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/warm=%v", tls, warm), func(t *testing.T) {
				peer := startUCXPeer(t, "xownlink", 5, 4<<20, tls)
				ini, _, req := peerRead(t, peer, ucxConfig(tls), 4<<20, time.Minute)
				if err := postWait(t, req, nil); err != nil {
					t.Fatal(err)
				}
				meta := base64.StdEncoding.EncodeToString(ini.LocalMetadata())
				notify := func(msg string) {
					t.Helper()
					got := peer.call("notify " + meta + " " + msg)
					t.Logf("peer's notification %q: %s", msg, got)
					if got != "SENT" {
						if !strings.HasPrefix(got, "ERR ") {
							t.Fatalf("peer said %q", got)
						}
						return
					}
					if nt := recvNotif(t, ini); string(nt.Msg) != msg {
						t.Fatalf("notification %q, want %q", nt.Msg, msg)
					}
				}
				if warm {
					notify("one")
				}
				stallRead(t, peer, req)
				notify("two")
				notify("three")
			})
		}
	}
}
