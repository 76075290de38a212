package instance

import (
	"net/http"
	"sync/atomic"
)

// dispatcher is the HTTP handler of an instance with several data-parallel ranks. It hands each
// completion to the rank with the fewest completions in flight, the next rank in turn among
// equals, as vLLM's data-parallel front end balances by each engine's load; the rank's OpenAI
// server then serves it whole. The other routes (models, tokenize, version, health, metrics)
// answer alike on every rank and go to rank 0, whose /metrics serves every rank's series.
type dispatcher struct {
	ranks []*Rank
	turn  atomic.Uint64
}

// ServeHTTP implements http.Handler.
func (d *dispatcher) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || (r.URL.Path != "/v1/completions" && r.URL.Path != "/v1/chat/completions") {
		d.ranks[0].server.ServeHTTP(w, r)
		return
	}
	rk := d.pick()
	defer rk.inFlight.Add(-1)
	rk.server.ServeHTTP(w, r)
}

// pick returns the least loaded rank, counting the completion it is picked for.
func (d *dispatcher) pick() *Rank {
	n := uint64(len(d.ranks))
	first := d.turn.Add(1)
	best := d.ranks[first%n]
	for i := uint64(1); i < n; i++ {
		if rk := d.ranks[(first+i)%n]; rk.inFlight.Load() < best.inFlight.Load() {
			best = rk
		}
	}
	best.inFlight.Add(1)
	return best
}
