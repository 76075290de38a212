package connector

import (
	"reflect"
	"testing"
	"time"
)

var t0 = time.Date(2026, 11, 29, 10, 0, 0, 0, time.UTC)

func TestLeaseNotifyFreesAfterAllReaders(t *testing.T) {
	var tab LeaseTable
	tab.Add("p1", []int32{1, 2}, t0.Add(30*time.Second), true)
	if l, known := tab.Notify("p1", 2); l != nil || !known {
		t.Fatalf("first of two notifications released the lease: %v %v", l, known)
	}
	l, known := tab.Notify("p1", 2)
	if !known || l == nil || !reflect.DeepEqual(l.Blocks, []int32{1, 2}) {
		t.Fatalf("second notification: %v %v", l, known)
	}
	if _, known := tab.Notify("p1", 2); known {
		t.Error("a late notification for a released lease is reported as known")
	}
}

func TestLeaseHeartbeatExtendsNeverShortens(t *testing.T) {
	var tab LeaseTable
	tab.Add("a", nil, t0.Add(30*time.Second), true)
	tab.Add("ttl", nil, t0.Add(30*time.Second), false)
	if n := tab.Heartbeat([]string{"a", "ttl", "unknown"}, t0.Add(25*time.Second), 20*time.Second); n != 1 {
		t.Errorf("extended %d leases, want 1 (decoder TTLs are not renewed, unknown ids ignored)", n)
	}
	if got := tab.Get("a").Deadline; !got.Equal(t0.Add(45 * time.Second)) {
		t.Errorf("deadline = %v, want now+20s", got)
	}
	tab.Heartbeat([]string{"a"}, t0, 20*time.Second) // would shorten: ignored
	if got := tab.Get("a").Deadline; !got.Equal(t0.Add(45 * time.Second)) {
		t.Errorf("a heartbeat shortened the lease to %v", got)
	}
}

// TestLeaseExpireSweepsEveryEntry is vllm#58222: an unexpired entry must not hide expired ones.
func TestLeaseExpireSweepsEveryEntry(t *testing.T) {
	var tab LeaseTable
	tab.Add("long", nil, t0.Add(480*time.Second), false)
	tab.Add("b", nil, t0.Add(30*time.Second), true)
	tab.Add("a", nil, t0.Add(30*time.Second), true)
	tab.Add("renewed", nil, t0.Add(10*time.Second), true)
	tab.Heartbeat([]string{"renewed"}, t0.Add(5*time.Second), 100*time.Second)
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
	if ids, ok := ParseHeartbeat(FormatHeartbeat([]string{"a", "b"})); !ok || !reflect.DeepEqual(ids, []string{"a", "b"}) {
		t.Errorf("heartbeat round trip = %v %v", ids, ok)
	}
	if _, ok := ParseHeartbeat("req:1"); ok {
		t.Error("a read notification parsed as a heartbeat")
	}
}
