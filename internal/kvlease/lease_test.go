package kvlease

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)

// ids returns n prompt tokens: 100, 101, ….
func ids(n int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = 100 + int32(i)
	}
	return out
}

// proven returns a release of the lease of id under tok by one of readers readers holding
// prompt, and adds the proof of prompt to l's accepted ones.
func proven(l *Lease, id string, tok Token, readers int, prompt []int32) Release {
	if l.Proofs == nil {
		l.Proofs = map[int][ProofBytes]byte{}
	}
	l.Proofs[len(prompt)] = Proof(l.Token, prompt)
	return Release{ID: id, Readers: readers, Token: tok, Proven: len(prompt), Proof: Proof(tok, prompt)}
}

func TestLeaseNotifyFreesAfterAllReaders(t *testing.T) {
	var tab Table
	tok := Token{7}
	lease, _ := tab.Add("p1", tok, []int32{1, 2}, t0, t0.Add(30*time.Second), true)
	r := proven(lease, "p1", tok, 2, ids(5))
	if l, res := tab.Notify(r); l != nil || res != NotifyCounted {
		t.Fatalf("first of two notifications released the lease: %v %v", l, res)
	}
	l, res := tab.Notify(r)
	if res != NotifyCounted || l == nil || !reflect.DeepEqual(l.Blocks, []int32{1, 2}) {
		t.Fatalf("second notification: %v %v", l, res)
	}
	if _, res := tab.Notify(r); res != NotifyUnknown {
		t.Error("a late notification for a released lease is not reported as unknown")
	}
}

// TestLeaseNotifyNeedsTheTokenAndTheProof: a notification that names a lease's request id but
// presents another token, or the token without a proof of the lease's prompt (another prompt,
// another length, or a proof made for another token), neither counts as a reader nor ends the
// lease.
func TestLeaseNotifyNeedsTheTokenAndTheProof(t *testing.T) {
	var tab Table
	tok := Token{1}
	l, _ := tab.Add("victim", tok, []int32{4}, t0, t0.Add(30*time.Second), true)
	good := proven(l, "victim", tok, 1, ids(6))
	other := ids(7)[1:] // six other tokens
	for name, tc := range map[string]struct {
		r    Release
		want NotifyResult
	}{
		"another token":         {Release{ID: "victim", Readers: 1, Token: Token{2}, Proven: 6, Proof: good.Proof}, NotifyRefused},
		"another prompt":        {Release{ID: "victim", Readers: 1, Token: tok, Proven: 6, Proof: Proof(tok, other)}, NotifyUnproven},
		"a shorter prefix":      {Release{ID: "victim", Readers: 1, Token: tok, Proven: 5, Proof: Proof(tok, ids(5))}, NotifyUnproven},
		"nothing proven":        {Release{ID: "victim", Readers: 1, Token: tok, Proven: 0, Proof: Proof(tok, nil)}, NotifyUnproven},
		"another token's proof": {Release{ID: "victim", Readers: 1, Token: tok, Proven: 6, Proof: Proof(Token{2}, ids(6))}, NotifyUnproven},
	} {
		for range 3 {
			if l, res := tab.Notify(tc.r); l != nil || res != tc.want {
				t.Fatalf("%s: %v %v, want %v", name, l, res, tc.want)
			}
		}
	}
	if l, res := tab.Notify(good); l == nil || res != NotifyCounted {
		t.Fatalf("the owner's notification: %v %v", l, res)
	}
}

func TestLeaseHeartbeatExtendsNeverShortens(t *testing.T) {
	var tab Table
	a, ttl := Token{1}, Token{2}
	tab.Add("a", a, nil, t0, t0.Add(30*time.Second), true)
	tab.Add("ttl", ttl, nil, t0, t0.Add(30*time.Second), false)
	if n := tab.Heartbeat([]Token{a, ttl, {9}}, t0.Add(25*time.Second), 20*time.Second); n != 1 {
		t.Errorf("extended %d leases, want 1 (decoder TTLs are not renewed, unknown tokens ignored)", n)
	}
	if got := tab.Get("a").Deadline; !got.Equal(t0.Add(45 * time.Second)) {
		t.Errorf("deadline = %v, want now+20s", got)
	}
	tab.Heartbeat([]Token{a}, t0, 20*time.Second) // would shorten: ignored
	if got := tab.Get("a").Deadline; !got.Equal(t0.Add(45 * time.Second)) {
		t.Errorf("a heartbeat shortened the lease to %v", got)
	}
}

// TestLeaseExpireSweepsEveryEntry is vllm#58222: an unexpired entry must not hide expired ones.
func TestLeaseExpireSweepsEveryEntry(t *testing.T) {
	var tab Table
	renewed := Token{4}
	tab.Add("long", Token{1}, nil, t0, t0.Add(480*time.Second), false)
	tab.Add("b", Token{2}, nil, t0, t0.Add(30*time.Second), true)
	tab.Add("a", Token{3}, nil, t0, t0.Add(30*time.Second), true)
	tab.Add("renewed", renewed, nil, t0, t0.Add(10*time.Second), true)
	tab.Heartbeat([]Token{renewed}, t0.Add(5*time.Second), 100*time.Second)
	got := tab.Expire(t0.Add(31 * time.Second))
	var ids []string
	for _, l := range got {
		ids = append(ids, l.RequestID)
	}
	if !reflect.DeepEqual(ids, []string{"a", "b"}) || tab.Len() != 2 {
		t.Errorf("expired %v (left %d), want [a b] and 2 left", ids, tab.Len())
	}
	if next, ok := tab.NextDeadline(); !ok || !next.Equal(t0.Add(105*time.Second)) {
		t.Errorf("next deadline = %v %v", next, ok)
	}
}

// TestLeaseSlotsAreReused: every live lease has its own slot; a slot is handed out again only
// after its lease left the table.
func TestLeaseSlotsAreReused(t *testing.T) {
	var tab Table
	slots := map[int]string{}
	for i, id := range []string{"a", "b", "c"} {
		l, _ := tab.Add(id, Token{byte(i + 1)}, nil, t0, t0.Add(time.Minute), true)
		if other, dup := slots[l.Slot]; dup {
			t.Fatalf("%s got slot %d, held by %s", id, l.Slot, other)
		}
		slots[l.Slot] = id
	}
	freed := tab.Get("b").Slot
	tab.Release("b")
	if l, _ := tab.Add("d", Token{9}, nil, t0, t0.Add(time.Minute), true); l.Slot != freed {
		t.Errorf("d got slot %d, want b's freed slot %d", l.Slot, freed)
	}
	if l, _ := tab.Add("e", Token{10}, nil, t0, t0.Add(time.Minute), true); l.Slot != 3 {
		t.Errorf("e got slot %d, want 3", l.Slot)
	}
}

// TestEvictOldestHold: decoder holds (non-renewable) are evicted oldest first; a producer's
// leases never are.
func TestEvictOldestHold(t *testing.T) {
	var tab Table
	tab.Add("lease", Token{1}, []int32{1}, t0, t0.Add(time.Minute), true)
	tab.Add("new", Token{2}, []int32{2}, t0.Add(2*time.Second), t0.Add(time.Hour), false)
	tab.Add("old", Token{3}, []int32{3}, t0.Add(time.Second), t0.Add(time.Hour), false)
	var got []string
	for l := tab.EvictOldestHold(); l != nil; l = tab.EvictOldestHold() {
		got = append(got, l.RequestID)
	}
	if !reflect.DeepEqual(got, []string{"old", "new"}) || tab.Len() != 1 || tab.Get("lease") == nil {
		t.Errorf("evicted %v, left %d; want [old new] and the producer's lease kept", got, tab.Len())
	}
	if tab.ByToken(Token{3}) != nil {
		t.Error("an evicted hold is still found by its token")
	}
}

func TestLeaseTagBindsTheParams(t *testing.T) {
	tok := Token{1, 2, 3}
	base := Tag(tok, 37, []int32{4, 5, 6}, []uint64{1, 1, 2})
	for name, tag := range map[string][16]byte{
		"token":       Tag(Token{1, 2, 4}, 37, []int32{4, 5, 6}, []uint64{1, 1, 2}),
		"tokens":      Tag(tok, 36, []int32{4, 5, 6}, []uint64{1, 1, 2}),
		"blocks":      Tag(tok, 37, []int32{4, 5, 7}, []uint64{1, 1, 2}),
		"generations": Tag(tok, 37, []int32{4, 5, 6}, []uint64{1, 1, 3}),
	} {
		if tag == base {
			t.Errorf("changing the %s leaves the tag unchanged", name)
		}
	}
	if Tag(tok, 37, []int32{4, 5, 6}, []uint64{1, 1, 2}) != base {
		t.Error("the tag is not deterministic")
	}
}

func TestHeartbeatTrackerBatches(t *testing.T) {
	h := HeartbeatTracker{Interval: 5 * time.Second}
	h.Track("P1", "r2")
	h.Track("P1", "r1")
	h.Track("P2", "x")
	want := []HeartbeatBatch{{"P1", []string{"r1", "r2"}}, {"P2", []string{"x"}}}
	if got := h.Due(t0); !reflect.DeepEqual(got, want) {
		t.Fatalf("Due = %v, want %v", got, want)
	}
	if got := h.Due(t0.Add(4 * time.Second)); len(got) != 0 {
		t.Errorf("batches before the interval: %v", got)
	}
	h.Untrack("P2", "x")
	h.Untrack("P1", "r1")
	if got := h.Due(t0.Add(5 * time.Second)); !reflect.DeepEqual(got, []HeartbeatBatch{{"P1", []string{"r2"}}}) {
		t.Errorf("Due after untrack = %v", got)
	}
	if h.Len() != 1 {
		t.Errorf("Len = %d", h.Len())
	}
	// Two requests carry the same token (copied params): the one that ends first does not
	// stop the other's heartbeats.
	h.Track("P1", "r2")
	h.Untrack("P1", "r2")
	if got := h.Due(t0.Add(10 * time.Second)); !reflect.DeepEqual(got, []HeartbeatBatch{{"P1", []string{"r2"}}}) {
		t.Errorf("Due after one of two requests with a token untracked it = %v", got)
	}
	h.Untrack("P1", "r2")
	h.Untrack("P1", "r2")
	if h.Len() != 0 {
		t.Errorf("Len after both untracked = %d", h.Len())
	}
}

func TestNotificationFormats(t *testing.T) {
	if ids, ok := ParseHeartbeat(FormatHeartbeat([]string{"a", "b"})); !ok || !reflect.DeepEqual(ids, []string{"a", "b"}) {
		t.Errorf("heartbeat round trip = %v %v", ids, ok)
	}
	tok := Token{0xab, 1}
	r := Release{ID: "cmpl-x:y:z-0", Readers: 1, Token: tok, Proven: 40, Proof: [ProofBytes]byte{0xcd, 2}}
	msg := FormatRelease(r)
	if msg != "cmpl-x:y:z-0:1:ab010000000000000000000000000000:40:cd020000000000000000000000000000" {
		t.Errorf("release message %q", msg)
	}
	if _, ok := ParseHeartbeat(msg); ok {
		t.Error("a read notification parsed as a heartbeat")
	}
	if got, err := ParseRelease(msg); err != nil || got != r {
		t.Errorf("ParseRelease = %+v %v, want %+v", got, err, r)
	}
	// Version 2 appends the reader's TP size; version 1 still parses (ReaderTP 0).
	r2 := r
	r2.ReaderTP = 4
	msg2 := FormatRelease(r2)
	if msg2 != msg+":tp4" || string(AppendReaderTP([]byte(msg), 4)) != msg2 {
		t.Errorf("version-2 release message %q, AppendReaderTP %q", msg2, AppendReaderTP([]byte(msg), 4))
	}
	if got, err := ParseRelease(msg2); err != nil || got != r2 {
		t.Errorf("ParseRelease(v2) = %+v %v, want %+v", got, err, r2)
	}
	proof := ":" + strings.Repeat("0", 2*ProofBytes)
	for _, bad := range []string{
		msg + ":tp0",
		msg + ":tp-1",
		msg + ":tpx",
		msg + ":tp4097",
		"req:1:" + tok.String() + ":tp2", // a TP size is no proof
		"req:1",
		"req:1:" + tok.String(), // the format before release proofs
		"req:0:" + tok.String() + ":4" + proof,
		":1:" + tok.String() + ":4" + proof,
		"req:1:xyz:4" + proof,
		"req:x:" + tok.String() + ":4" + proof,
		"req:1:" + tok.String() + ":-1" + proof,
		"req:1:" + tok.String() + ":4:" + strings.Repeat("z", 2*ProofBytes),
		"req:1:" + tok.String() + ":4:abcd",
	} {
		if _, err := ParseRelease(bad); err == nil {
			t.Errorf("ParseRelease(%q) accepted it", bad)
		}
	}
}

// TestReleaseProofBindsTokenAndPrompt: the proof changes with the token, any token of the
// prompt and its length.
func TestReleaseProofBindsTokenAndPrompt(t *testing.T) {
	tok := Token{5}
	prompt := ids(20)
	base := Proof(tok, prompt)
	edited := slices.Clone(prompt)
	edited[13]++
	for name, p := range map[string][ProofBytes]byte{
		"token":  Proof(Token{6}, prompt),
		"prompt": Proof(tok, edited),
		"length": Proof(tok, prompt[:19]),
	} {
		if p == base {
			t.Errorf("changing the %s leaves the proof unchanged", name)
		}
	}
	if Proof(tok, slices.Clone(prompt)) != base {
		t.Error("the proof is not deterministic")
	}
	// The owner's proofs of several prefixes, hashed in one pass, are the readers'.
	lengths := []int{0, 4, 8, 19, 20}
	for i, p := range Proofs(tok, prompt, lengths) {
		if p != Proof(tok, prompt[:lengths[i]]) {
			t.Errorf("the proof of the first %d tokens differs from a reader's", lengths[i])
		}
	}
}
