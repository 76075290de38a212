package connector

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/kvbridge/kvbridge/engine"
	"github.com/kvbridge/kvbridge/transfer"
)

// Layer-by-layer push (kv_connector_extra_config.push_layerwise on a NixlPushConnector
// prefiller): when a decoder registers while the prefill computes (both legs at once), each
// layer's KV of each prefill chunk is written as soon as the model computed it, while the next
// layers and chunks compute; the completion then follows the last write. A registration
// usually arrives while the prefill already computes (the decoder handshakes and allocates as
// the prefiller starts): the stream then starts at the next layer, first writing what was
// computed before it (the chunk's finished layers; whole blocks of earlier chunks or of this
// engine's prefix-cache hit) in one catch-up WRITE. The engine tells the
// connector of each step (engine.LayerStreamer, StreamStep) and of each layer (the function
// StreamStep returns, on the step loop: it only queues); one goroutine per streamed request
// writes its queue in order, so that a block a later chunk completes is written again after
// the earlier, partial write. Fewer, larger writes: the goroutine takes every layer of the same
// chunk already queued into one WRITE (contiguous ranges merged: consecutive layers of a block,
// and consecutive blocks, are one range), and in a chunk that another follows it waits for a
// group of layers (streamWrites). Anything that makes the streamed KV doubtful — a preemption
// (the blocks were freed and recomputed), a full queue, a failed write — marks the stream
// broken, and the request is then written whole when it ends, as without push_layerwise.

// maxStreamQueue bounds the layer writes queued for one request (in units of layers).
const maxStreamQueue = 1024

// streamWrites is how many WRITEs a layer-by-layer push makes per prefill chunk at most, but the
// prompt's last (when the model has more layers, each WRITE waits for a group of consecutive
// layers): each WRITE has a fixed cost (posting, a round trip) that per-layer writes pay once
// per layer, and a chunk followed by another has time to write its groups while the next
// computes. The last chunk writes each layer as it comes: what is left to write once the model
// is done, before the completion, stays one layer.
const streamWrites = 2

// streamGroup returns how many layers one WRITE of a layer-by-layer push waits for in a chunk
// that does not end the prompt.
func (c *Connector) streamGroup() int { return max(1, (c.geo.NumLayers+streamWrites-1)/streamWrites) }

// streamWrite is what one step adds to a request's stream: the pairs (this engine's block, the
// decoder's block) the step's chunk touches, to be written layer by layer.
type streamWrite struct {
	id      string
	peer    string
	peerInc uint64
	reg     pushRegistration
	pairs   [][2]int32
	final   bool // the chunk ends the prompt
}

// streamStart reports whether w's chunk, a prefill leg (do_remote_decode) naming a push_id, may
// be streamed now: its decoder's registration is parked here, for the same prompt. It returns
// the chunk's write and, when w's request starts streaming with this chunk, the pairs of the
// registered blocks before it (computed by earlier steps, or found in this engine's prefix
// cache: complete in every layer), which a catch-up WRITE sends first. wait is true when w's
// request is such a prefill leg but no registration names it yet: one that arrives while the
// step computes starts the stream at the next layer (Connector.StreamStep). It records on the
// request its prompt's digest and that it streams; nothing else changes.
func (k *core) streamStart(w engine.Work) (sw streamWrite, prior [][2]int32, ok, wait bool) {
	st := k.reqs[w.Seq.ID()]
	if st == nil || st.params == nil || !st.params.DoRemoteDecode || st.params.PushID == "" {
		return streamWrite{}, nil, false, false
	}
	pr, parked := k.push.parked[st.params.PushID]
	if !parked {
		return streamWrite{}, nil, false, !st.streaming
	}
	if pr.reg.NumTokens != w.Seq.NumPromptTokens() {
		return streamWrite{}, nil, false, false
	}
	if st.digest == nil {
		st.digest = promptDigest(w.Seq.Prompt())
	}
	if !bytes.Equal(st.digest, pr.reg.Digest) {
		return streamWrite{}, nil, false, false
	}
	bs := k.geo.BlockSize
	pair := func(i int) ([2]int32, bool) {
		if j := i - pr.reg.FirstBlock; j >= 0 && j < len(pr.reg.BlockIDs) && i < len(w.Blocks) {
			return [2]int32{w.Blocks[i], pr.reg.BlockIDs[j]}, true
		}
		return [2]int32{}, false
	}
	if !st.streaming {
		// Every registered block before this chunk's first is complete here.
		for i := pr.reg.FirstBlock; i < w.Start/bs; i++ {
			if p, ok := pair(i); ok {
				prior = append(prior, p)
			}
		}
	}
	st.streaming = true
	end := min(w.Start+len(w.Tokens), w.Seq.NumPromptTokens())
	var pairs [][2]int32
	for i := w.Start / bs; i*bs < end; i++ {
		if p, ok := pair(i); ok {
			pairs = append(pairs, p)
		}
	}
	if len(pairs) == 0 && len(prior) == 0 {
		return streamWrite{}, nil, false, false
	}
	return streamWrite{id: w.Seq.ID(), peer: pr.peer, peerInc: pr.peerInc, reg: pr.reg, pairs: pairs, final: end == w.Seq.NumPromptTokens()}, prior, true, false
}

// stream is one request's layer-by-layer push, written by its own goroutine (runStream).
type stream struct {
	id      string
	peer    string
	peerInc uint64
	reg     pushRegistration
	jobs    chan streamJob
	finish  chan pushJob // the request's push, once it finished prefill (capacity 1)
	broken  atomic.Bool
	chunks  int // steps streamed so far (the step loop's only)
}

// streamJob is one layer of one step's blocks; chunk numbers the step in the request's stream,
// group is how many layers of that chunk a WRITE waits for (nextBatch).
type streamJob struct {
	chunk int
	group int
	layer int
	pairs [][2]int32
}

// nextBatch returns the jobs to write in one WRITE: first and the jobs of the same chunk after
// it. While the batch holds fewer than first.group layers and not the chunk's last layer
// (lastLayer), it waits for the next one (the per-WRITE cost then buys several layers), unless
// the request's push was handed over (it then stores it in *pending) or ctx ended; beyond that
// it takes only what is already queued. A job of the next chunk ends the batch and is returned
// as next (nil: none taken).
func (s *stream) nextBatch(ctx context.Context, first streamJob, lastLayer int, pending **pushJob) (batch []streamJob, next *streamJob) {
	batch = []streamJob{first}
	for {
		var j streamJob
		if len(batch) >= first.group || batch[len(batch)-1].layer >= lastLayer || *pending != nil {
			select {
			case j = <-s.jobs:
			default:
				return batch, nil
			}
		} else {
			select {
			case j = <-s.jobs:
			case pj := <-s.finish:
				*pending = &pj
				continue
			case <-ctx.Done():
				return batch, nil
			}
		}
		if j.chunk != first.chunk {
			return batch, &j
		}
		batch = append(batch, j)
	}
}

// layerRange is one range a stream writes: at local in this engine's KV region, at remote in the
// decoder's, length bytes.
type layerRange struct{ local, remote, length int64 }

// layerRanges returns the ranges jobs write, given the bytes of a block here and on the
// decoder and of one layer of a block, sorted and merged where both sides are contiguous.
func layerRanges(jobs []streamJob, blockBytes, remoteBlockLen, layerBytes int64) []layerRange {
	var out []layerRange
	for _, j := range jobs {
		for _, p := range j.pairs {
			out = append(out, layerRange{int64(p[0])*blockBytes + int64(j.layer)*layerBytes, int64(p[1])*remoteBlockLen + int64(j.layer)*layerBytes, layerBytes})
		}
	}
	slices.SortFunc(out, func(a, b layerRange) int { return cmp.Compare(a.local, b.local) })
	merged := out[:0]
	for _, r := range out {
		if n := len(merged); n > 0 {
			if last := &merged[n-1]; last.local+last.length == r.local && last.remote+last.length == r.remote {
				last.length += r.length
				continue
			}
		}
		merged = append(merged, r)
	}
	return merged
}

// queue adds a job without blocking; a full queue breaks the stream.
func (s *stream) queue(j streamJob) {
	select {
	case s.jobs <- j:
	default:
		s.broken.Store(true)
	}
}

// StreamStep implements engine.LayerStreamer (see pushstream.go's doc): it starts the streams of
// the step's requests that have a decoder's registration, marks those of preempted requests
// broken, and returns the function that queues each layer's writes (nil when no request of the
// step may stream). A registration that arrives while the step computes starts its request's
// stream at the next layer, with a catch-up of what was computed before it.
func (c *Connector) StreamStep(work []engine.Work, preempted []*engine.Sequence) func(layer int) {
	if !c.cfg.PushLayerwise {
		return nil
	}
	step := &stepStream{c: c}
	c.locked(func() {
		for _, q := range preempted {
			if s := c.streams[q.ID()]; s != nil {
				s.broken.Store(true) // its blocks were freed: what was written may be stale
			}
		}
		if c.closed {
			return
		}
		for _, w := range work {
			sw, prior, ok, wait := c.core.streamStart(w)
			switch {
			case ok:
				step.start(sw, prior, 0)
			case wait:
				step.waiting = append(step.waiting, w)
			}
		}
	})
	if len(step.streams) == 0 && len(step.waiting) == 0 {
		return nil
	}
	return step.layer
}

// stepStream is one step's layer-by-layer pushes, owned by the step loop (StreamStep and the
// function it returns).
type stepStream struct {
	c       *Connector
	streams []*stream
	jobs    []streamJob   // the step's job for each stream, but the layer
	waiting []engine.Work // push prefill legs whose registration had not come when the step began
}

// start starts (or continues) sw's stream with this step's chunk, of which layers [0, done) were
// computed already: they are queued at once, after prior (whole blocks computed before the
// chunk, every layer). The caller holds c.mu.
func (st *stepStream) start(sw streamWrite, prior [][2]int32, done int) {
	c := st.c
	s := c.streams[sw.id]
	if s == nil {
		s = &stream{id: sw.id, peer: sw.peer, peerInc: sw.peerInc, reg: sw.reg, jobs: make(chan streamJob, maxStreamQueue), finish: make(chan pushJob, 1)}
		c.streams[sw.id] = s
		c.wg.Add(1)
		go c.runStream(s)
	}
	layers := c.geo.NumLayers
	if len(prior) > 0 {
		s.chunks++
		for l := range layers {
			s.queue(streamJob{chunk: s.chunks, group: layers, layer: l, pairs: prior})
		}
	}
	s.chunks++
	j := streamJob{chunk: s.chunks, group: c.streamGroup(), pairs: sw.pairs}
	if sw.final {
		j.group = 1
	}
	if len(sw.pairs) == 0 {
		return // the chunk holds no registered block: nothing to write layer by layer
	}
	for l := range done {
		s.queue(streamJob{chunk: j.chunk, group: done, layer: l, pairs: sw.pairs})
	}
	st.streams, st.jobs = append(st.streams, s), append(st.jobs, j)
}

// layer queues layer's writes of the step's streams, first starting those whose registration
// came since the step began.
func (st *stepStream) layer(layer int) {
	if len(st.waiting) > 0 {
		st.c.locked(func() {
			if st.c.closed {
				return
			}
			waiting := st.waiting[:0]
			for _, w := range st.waiting {
				sw, prior, ok, wait := st.c.core.streamStart(w)
				switch {
				case ok:
					st.start(sw, prior, layer)
				case wait:
					waiting = append(waiting, w)
				}
			}
			st.waiting = waiting
		})
	}
	for i, s := range st.streams {
		j := st.jobs[i]
		j.layer = layer
		s.queue(j)
	}
}

// handOverPush gives a finished request's push to its stream, if it has one; it reports whether
// it did.
func (c *Connector) handOverPush(j pushJob) bool {
	handed := false
	c.locked(func() {
		if s := c.streams[j.id]; s != nil {
			delete(c.streams, j.id)
			s.finish <- j
			handed = true
		}
	})
	return handed
}

// runStream writes s's queue in order until its request's push arrives, then completes it: with
// the completion alone when every layer was written, else by writing the request whole
// (runPush). A request that never finishes prefill here ends its stream after loadTimeout.
func (c *Connector) runStream(s *stream) {
	defer c.wg.Done()
	ctx, cancel := context.WithTimeout(c.ctx, loadTimeout)
	defer cancel()
	var r *remoteLink
	var pending *pushJob // the request's push, once handed over
	// write writes j and the jobs behind it, one WRITE per batch (nextBatch).
	write := func(j streamJob) {
		for next := &j; next != nil; {
			var batch []streamJob
			batch, next = s.nextBatch(ctx, *next, c.geo.NumLayers-1, &pending)
			if s.broken.Load() {
				continue
			}
			if err := c.streamLayers(ctx, s, &r, batch); err != nil {
				s.broken.Store(true)
				c.log.Warn("a layer-by-layer push write failed; the request will be written whole when its prefill ends", "request_id", s.id,
					"remote_engine_id", s.reg.EngineID, "layers", len(batch), "err", err)
			}
		}
	}
	for {
		if pending != nil {
			select {
			case j := <-s.jobs:
				write(j)
			default:
			}
			c.finishStream(s, r, *pending)
			return
		}
		select {
		case j := <-s.jobs:
			write(j)
		case pj := <-s.finish:
			pending = &pj
		case <-ctx.Done():
			handed := false
			c.locked(func() {
				if c.streams[s.id] == s {
					delete(c.streams, s.id)
				} else {
					handed = true // the push was handed over meanwhile: it is in s.finish
				}
			})
			if handed {
				s.broken.Store(true)
				c.finishStream(s, r, <-s.finish)
			}
			return
		}
	}
}

// streamLayers writes some layers of one step's blocks into the decoder's in one WRITE,
// handshaking the decoder first.
func (c *Connector) streamLayers(ctx context.Context, s *stream, r **remoteLink, jobs []streamJob) error {
	link, left, err := c.pushTarget(ctx, s.id, s.reg, s.peer, s.peerInc)
	if err != nil {
		return err
	}
	*r = link
	if link.tp != nil {
		for _, j := range jobs { // another TP size: chunks of heads, a layer at a time
			if err := c.streamChunks(ctx, link, left, j); err != nil {
				return err
			}
		}
		return nil
	}
	for _, p := range jobs[0].pairs { // every job of a batch has its chunk's pairs
		if int(p[1]) >= link.meta.NumBlocks {
			return fmt.Errorf("%w: the registration names block %d, engine %s has %d", ErrParams, p[1], link.id, link.meta.NumBlocks)
		}
	}
	blockBytes := int64(c.pool.BlockBytes())
	ranges := layerRanges(jobs, blockBytes, int64(link.meta.BlockLen), blockBytes/int64(c.geo.NumLayers))
	local := make([]transfer.Desc, len(ranges))
	remote := make([]transfer.Desc, len(ranges))
	for i, g := range ranges {
		local[i] = c.kvReg.Desc(g.local, g.length)
		remote[i] = transfer.Desc{Region: link.meta.KVRegion, Offset: g.remote, Length: g.length}
	}
	w, err := c.agent.CreateRequest(ctx, transfer.Write, local, link.peer, remote, &transfer.RequestOptions{Timeout: min(loadTimeout, left-expiryMargin/2)})
	if err != nil {
		return err
	}
	return c.runWrite(ctx, w, nil)
}

// finishStream completes a streamed push: every layer of every chunk landed, so only the
// completion is sent; a broken stream is written whole instead.
func (c *Connector) finishStream(s *stream, r *remoteLink, j pushJob) {
	if s.broken.Load() || r == nil || j.peer != s.peer || j.peerInc != s.peerInc {
		c.runPush(j)
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, registerTimeout)
	defer cancel()
	if err := c.agent.SendNotif(ctx, r.peer, j.completion()); err != nil {
		c.log.Error("NIXL transfer failure: push_failed (the completion of a layer-by-layer push)", "request_id", j.id, "remote_engine_id", j.reg.EngineID, "err", err)
		if c.metrics != nil {
			c.metrics.CountFailedNotification()
		}
	}
	c.event(func(k *core) { k.pushEnded(j.id, false) })
}
