package instance

import (
	"bytes"
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/kvbridge/kvbridge/openai"
)

// dispatcher is the HTTP handler of an instance with several data-parallel ranks. It hands each
// completion to the rank with the fewest completions in flight, the next rank in turn among
// equals, as vLLM's data-parallel front end balances by each engine's load; the rank's OpenAI
// server then serves it whole. The other routes (models, tokenize, version, health, metrics)
// answer alike on every rank and go to rank 0, whose /metrics serves every rank's series.
//
// A completion whose body names a "push_id" is the prefill leg of a push whose two legs a proxy
// sent at once (connector/push.go): its decoder registers with the engine GET /v1/kv_transfer
// reports, which is rank 0's, so the leg goes to rank 0. (The serial push flow needs nothing:
// the decoder registers with the rank that answered, named in its params.)
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
	var rk *Rank
	if namesPushID(w, r) {
		rk = d.ranks[0]
		rk.inFlight.Add(1)
	} else {
		rk = d.pick()
	}
	defer rk.inFlight.Add(-1)
	rk.server.ServeHTTP(w, r)
}

// namesPushID reads r's body (under the OpenAI server's size and time bounds) and reports
// whether it contains the key "push_id"; r.Body then replays what was read, and the error the
// read ended with, for the server to answer as it would have. A prompt that merely contains the
// text only sends the request to rank 0.
func namesPushID(w http.ResponseWriter, r *http.Request) bool {
	_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(openai.DefaultBodyReadTimeout))
	body, err := io.ReadAll(io.LimitReader(r.Body, openai.DefaultMaxBodyBytes+1))
	if err == nil {
		err = io.EOF
	}
	r.Body = replay{io.MultiReader(bytes.NewReader(body), errReader{err}), r.Body}
	return bytes.Contains(body, []byte(`"push_id"`))
}

// replay is a request body read ahead: the bytes read, then the read's error.
type replay struct {
	io.Reader
	io.Closer
}

// errReader returns err on every read.
type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

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
