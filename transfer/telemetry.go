package transfer

import (
	"errors"
	"sync/atomic"
	"time"
)

// RequestTelemetry describes one finished post of a request. Durations are measured by the
// engine when the transfer completes, not when someone polls.
type RequestTelemetry struct {
	Request          uint64
	Peer             string
	Op               Op
	Backend          Backend
	PostTime         time.Time     // when Post was called
	PostDuration     time.Duration // time spent inside Post (up to handing the work over)
	TransferDuration time.Duration // from Post to completion (data complete and notification sent)
	Bytes            int64
	Descs            int   // descriptors before merging
	MergedDescs      int   // descriptors after merging contiguous runs
	Err              error // nil on success
}

// FailureCounts counts failures by kind.
type FailureCounts struct {
	Timeout           int64
	RemoteDisconnect  int64
	StaleIncarnation  int64
	Permission        int64
	InvalidDescriptor int64
	NotFound          int64
	Canceled          int64
	Protocol          int64
	Closed            int64
	Other             int64
}

// Total returns the sum of all kinds.
func (f FailureCounts) Total() int64 {
	return f.Timeout + f.RemoteDisconnect + f.StaleIncarnation + f.Permission + f.InvalidDescriptor +
		f.NotFound + f.Canceled + f.Protocol + f.Closed + f.Other
}

// Stats is a snapshot of an agent's counters.
type Stats struct {
	RequestsCompleted int64
	RequestsFailed    int64
	BytesRead         int64         // bytes pulled by completed READ requests (initiator)
	BytesWritten      int64         // bytes pushed by completed WRITE requests (initiator)
	ServedReadBytes   int64         // bytes peers READ from this agent over TCP (target)
	ServedWriteBytes  int64         // bytes peers WROTE into this agent over TCP (target)
	Failures          FailureCounts // failed requests by kind (initiator)
	Refused           FailureCounts // peer requests and connections refused by kind (target)
	AuthRefused       int64         // connections refused by authentication, either side (also in Refused.Permission)
	ReadsDenied       int64         // TCP READ frames refused by Config.AuthorizeRead (also in Refused.Permission)
	WritesDenied      int64         // TCP WRITE frames refused by Config.AuthorizeWrite (also in Refused.Permission)
	NotifsSent        int64
	NotifsReceived    int64
	NotifsDropped     int64 // dropped because the notification queue was full
	Fallbacks         int64 // lists prepared on a backend other than the first preference
	Connects          int64
	Disconnects       int64
	RegisteredBytes   int64
	MappedBytes       int64 // bytes of peers' arenas mapped into this process (SHM)
	InflightRequests  int64
}

// failureCounters is the atomic form of FailureCounts.
type failureCounters struct {
	timeout, disconnect, stale, permission, invalid, notFound, canceled, protocol, closed, other atomic.Int64
}

// add counts one failure of kind.
func (f *failureCounters) add(kind error) {
	switch {
	case errors.Is(kind, ErrTimeout):
		f.timeout.Add(1)
	case errors.Is(kind, ErrStaleIncarnation):
		f.stale.Add(1)
	case errors.Is(kind, ErrRemoteDisconnect):
		f.disconnect.Add(1)
	case errors.Is(kind, ErrPermission):
		f.permission.Add(1)
	case errors.Is(kind, ErrInvalidDescriptor):
		f.invalid.Add(1)
	case errors.Is(kind, ErrNotFound):
		f.notFound.Add(1)
	case errors.Is(kind, ErrCanceled):
		f.canceled.Add(1)
	case errors.Is(kind, ErrProtocol):
		f.protocol.Add(1)
	case errors.Is(kind, ErrClosed):
		f.closed.Add(1)
	default:
		f.other.Add(1)
	}
}

// snapshot returns the counts.
func (f *failureCounters) snapshot() FailureCounts {
	return FailureCounts{
		Timeout: f.timeout.Load(), RemoteDisconnect: f.disconnect.Load(), StaleIncarnation: f.stale.Load(),
		Permission: f.permission.Load(), InvalidDescriptor: f.invalid.Load(), NotFound: f.notFound.Load(),
		Canceled: f.canceled.Load(), Protocol: f.protocol.Load(), Closed: f.closed.Load(), Other: f.other.Load(),
	}
}

// agentStats holds the counters behind Stats.
type agentStats struct {
	completed, failed                         atomic.Int64
	bytesRead, bytesWritten                   atomic.Int64
	bytesIn, bytesOut                         atomic.Int64 // TCP payload moved (diagnostics)
	servedRead, servedWrite                   atomic.Int64
	failures, refused                         failureCounters
	notifsSent, notifsReceived, notifsDropped atomic.Int64
	fallbacks, connects, disconnects          atomic.Int64
	authRefused, readsDenied, writesDenied    atomic.Int64
	registeredBytes, mappedBytes              atomic.Int64
}

// record counts a finished post.
func (s *agentStats) record(t *RequestTelemetry) {
	if t.Err != nil {
		s.failed.Add(1)
		s.failures.add(t.Err)
		return
	}
	s.completed.Add(1)
	if t.Op == Read {
		s.bytesRead.Add(t.Bytes)
	} else {
		s.bytesWritten.Add(t.Bytes)
	}
}

// Stats returns a snapshot of the agent's counters.
func (a *Agent) Stats() Stats {
	s := &a.stats
	st := Stats{
		RequestsCompleted: s.completed.Load(), RequestsFailed: s.failed.Load(),
		BytesRead: s.bytesRead.Load(), BytesWritten: s.bytesWritten.Load(),
		ServedReadBytes: s.servedRead.Load(), ServedWriteBytes: s.servedWrite.Load(),
		Failures: s.failures.snapshot(), Refused: s.refused.snapshot(),
		AuthRefused: s.authRefused.Load(), ReadsDenied: s.readsDenied.Load(), WritesDenied: s.writesDenied.Load(),
		NotifsSent: s.notifsSent.Load(), NotifsReceived: s.notifsReceived.Load(), NotifsDropped: s.notifsDropped.Load(),
		Fallbacks: s.fallbacks.Load(), Connects: s.connects.Load(), Disconnects: s.disconnects.Load(),
		RegisteredBytes: s.registeredBytes.Load(), MappedBytes: s.mappedBytes.Load(),
	}
	st.InflightRequests = a.inflightRequests()
	return st
}

// inflightRequests counts the requests in flight to every peer.
func (a *Agent) inflightRequests() int64 {
	a.peersMu.Lock()
	defer a.peersMu.Unlock()
	var n int64
	for _, p := range a.peers {
		n += p.inflightCount()
	}
	return n
}

// inflightCount counts the requests in flight to the peer.
func (p *peer) inflightCount() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return int64(len(p.inflight))
}
