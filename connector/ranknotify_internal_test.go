package connector

import (
	"testing"

	"github.com/kvbridge/kvbridge/internal/kvlease"
)

// TestRankPairs: the notifications vLLM's ranks exchange per request, for a model of 2 KV heads
// (the derivations are TestLateReleaseCountsEveryRankPair's), and the sizes that cannot map.
func TestRankPairs(t *testing.T) {
	for _, tc := range []struct{ d, p, want int }{
		{1, 1, 1}, {2, 2, 2}, {4, 4, 4}, {1, 2, 2}, {2, 1, 2}, {1, 4, 2}, {4, 1, 4}, {2, 4, 2}, {4, 2, 4},
	} {
		if got, err := rankPairs(tc.d, tc.p, 2); err != nil || got != tc.want {
			t.Errorf("rankPairs(D TP %d, P TP %d) = %d %v, want %d", tc.d, tc.p, got, err, tc.want)
		}
	}
	for _, tc := range [][2]int{{3, 2}, {2, 3}, {0, 1}, {maxRemoteTP + 2, 1}} {
		if got, err := rankPairs(tc[0], tc[1], 2); err == nil {
			t.Errorf("rankPairs(%d, %d) = %d, want an error", tc[0], tc[1], got)
		}
	}
}

// TestCoreLateReleaseTrustsOnlyConsistentTP: a release for a lease this engine (P, TP 1, 2 KV
// heads) no longer holds counts one notification per pair of D rank and P rank; the reader's
// TP size comes from its handshake when this engine made one, and a claim that contradicts it,
// or that cannot map onto this engine's TP size, counts once — a peer cannot inflate the
// counter by claiming a large TP.
func TestCoreLateReleaseTrustsOnlyConsistentTP(t *testing.T) {
	h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`)
	h.k.kvHeads = 2
	h.k.remotes[remoteKey{"D", "i"}] = &remoteRecord{key: remoteKey{"D", "i"}, link: &remoteLink{meta: agentMetadata{TPSize: 2}}, peer: "agent-D"}
	late := func(readerTP int) string {
		return kvlease.FormatRelease(kvlease.Release{ID: "gone", Readers: 1, Token: kvlease.Token{1}, ReaderTP: readerTP})
	}
	const name = "vllm:nixl_num_notifications_after_expiry_total"
	for _, tc := range []struct {
		what, peer string
		readerTP   int
		want       float64
	}{
		{"v1 from an engine never handshaken", "agent-X", 0, 1},
		{"v2 claiming TP 2, no handshake", "agent-X", 2, 2},
		{"v2 claiming TP 4, no handshake", "agent-X", 4, 4},
		{"v2 claiming TP 3, which cannot map", "agent-X", 3, 1},
		{"v1 from a handshaken TP 2 engine", "agent-D", 0, 2},
		{"v2 agreeing with the handshake", "agent-D", 2, 2},
		{"v2 contradicting the handshake", "agent-D", 4, 1},
	} {
		before := h.counter(name)
		h.k.notification(tc.peer, late(tc.readerTP), h.now)
		if got := h.counter(name) - before; got != tc.want {
			t.Errorf("%s: counted %v, want %v", tc.what, got, tc.want)
		}
	}
}

// TestCoreHeartbeatNamesTheProducerRanks: a heartbeat to a producer at TP 4 is, in vLLM, sent to
// each of its 4 ranks' agents, so the beat tells the worker to count 4 failed notifications if
// it cannot be sent; a producer at TP 1, one.
func TestCoreHeartbeatNamesTheProducerRanks(t *testing.T) {
	h := newCoreHarness(t, `{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}`)
	for engineID, tp := range map[string]int{"P4": 4, "P1": 0} {
		key := remoteKey{engineID, "i"}
		h.k.remotes[key] = &remoteRecord{key: key, link: &remoteLink{meta: agentMetadata{TPSize: tp}}, peer: "agent-" + engineID, lastUsed: h.now}
		h.k.heartbeats.Track(engineID+"\x00i", "aa")
	}
	h.k.tick(h.now)
	got := map[string]int{}
	for _, b := range h.k.take().beats {
		got[b.peer] = b.ranks
	}
	if got["agent-P4"] != 4 || got["agent-P1"] != 1 || len(got) != 2 {
		t.Errorf("beats name ranks %v, want agent-P4 4 and agent-P1 1", got)
	}
}
