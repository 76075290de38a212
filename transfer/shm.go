package transfer

import "sync/atomic"

// SHM backend: the peer passed its arena fds once over its Unix socket (SCM_RIGHTS) and this
// process mapped them (peer.maps). A transfer is a batch of copies between local memory
// and the mapping, executed by the agent's worker pool; large requests are split into chunks
// by bytes so several workers copy at once. No per-descriptor allocation: a request's chunk
// plan is computed once by MakeRequest and re-armed by each post. The completion
// notification is written to the peer's Unix socket after the last copy, so the system call
// orders the data before the message.

// Chunk sizing: requests up to shmSplitMin are one chunk; larger ones are cut into chunks
// of total/(4·workers), clamped to [shmChunkMin, shmChunkMax], so that idle workers (and a
// waiting caller, see Request.Wait) share the copy and one slow worker delays the request by
// at most one chunk. shmChunkMax also bounds how long cancellation waits for a copy.
const (
	shmSplitMin = 1 << 20
	shmChunkMin = 512 << 10
	shmChunkMax = 4 << 20
)

// Chunk states (low two bits of shmChunk.state; the post generation is in the upper bits).
const (
	chunkQueued = 0
	chunkBusy   = 1
	chunkDone   = 2
)

// shmChunk is a contiguous slice of a request's runs: from runs[first][firstOff:] to
// runs[last][:lastEnd].
type shmChunk struct {
	r        *Request
	first    int
	last     int
	firstOff int
	lastEnd  int
	state    atomic.Uint64 // gen<<2 | chunk state
}

// shmWork is one queued chunk of post gen.
type shmWork struct {
	c   *shmChunk
	gen uint64
}

// planChunks splits the runs into chunks of roughly equal bytes.
func (r *Request) planChunks() {
	total := r.bytes
	per := total
	if total > shmSplitMin {
		per = min(max(total/int64(4*r.a.cfg.Workers), shmChunkMin), shmChunkMax)
	}
	n := (total + per - 1) / per
	r.chunks = make([]shmChunk, 0, n)
	ri, roff := 0, 0
	for k := int64(0); k*per < total; k++ {
		want := min(per, total-k*per)
		r.chunks = append(r.chunks, shmChunk{})
		c := &r.chunks[len(r.chunks)-1]
		c.r, c.first, c.firstOff = r, ri, roff
		for want > 0 {
			avail := int64(len(r.runs[ri].local) - roff)
			if avail > want {
				roff += int(want)
				c.last, c.lastEnd = ri, roff
				want = 0
			} else {
				want -= avail
				c.last, c.lastEnd = ri, len(r.runs[ri].local)
				ri, roff = ri+1, 0
			}
		}
	}
}

// copy moves the chunk's bytes in the request's direction.
func (c *shmChunk) copy() {
	runs := c.r.runs
	read := c.r.op == Read
	for i := c.first; i <= c.last; i++ {
		rn := &runs[i]
		s, e := 0, len(rn.local)
		if i == c.first {
			s = c.firstOff
		}
		if i == c.last {
			e = c.lastEnd
		}
		if read {
			copy(rn.local[s:e], rn.remote[s:e])
		} else {
			copy(rn.remote[s:e], rn.local[s:e])
		}
	}
}

// abandon resolves the chunk of post gen if no worker has started it.
func (c *shmChunk) abandon(gen uint64) {
	if c.state.CompareAndSwap(gen<<2|chunkQueued, gen<<2|chunkDone) {
		c.r.unitDone()
	}
}

// help copies the still-queued chunks of post gen on the calling goroutine.
func (r *Request) help(gen uint64) {
	for i := range r.chunks {
		c := &r.chunks[i]
		if c.state.CompareAndSwap(gen<<2|chunkQueued, gen<<2|chunkBusy) {
			c.copy()
			c.state.Store(gen<<2 | chunkDone)
			r.unitDone()
		}
	}
}

// worker copies queued chunks until the work channel is closed (by Close).
func (a *Agent) worker() {
	defer a.wg.Done()
	for w := range a.work {
		c := w.c
		if !c.state.CompareAndSwap(w.gen<<2|chunkQueued, w.gen<<2|chunkBusy) {
			continue // abandoned (failed request) or stale
		}
		c.copy()
		c.state.Store(w.gen<<2 | chunkDone)
		c.r.unitDone()
	}
}
