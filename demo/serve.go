package demo

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/kvbridge/kvbridge/apiclient"
	"github.com/kvbridge/kvbridge/conversation"
	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/stack"
)

// ServeOptions configure Serve.
type ServeOptions struct {
	// Model is served by P and D (default kvbridge/small).
	Model string
	// ProxyPort, PrefillPort and DecodePort are tried first (`kvbridge demo --serve` asks for
	// the seed guide's 8000, 8100 and 8200); a port that is taken, or 0, is replaced by a free one.
	ProxyPort, PrefillPort, DecodePort int
	// Out receives the addresses and the curl commands to try.
	Out io.Writer
	// Logger receives the engines' and the proxy's logs (with the periodic "KV Transfer metrics"
	// line); nil discards.
	Logger *slog.Logger

	// ready, if set, sees the running stack before Serve waits (tests drive it).
	ready func(*stack.Stack)
}

// The seed guide's ports.
const (
	DefaultProxyPort   = 8000
	DefaultPrefillPort = 8100
	DefaultDecodePort  = 8200
)

// serveAnswerTokens is max_tokens of the suggested requests: a built-in model's random weights
// rarely produce EOS, so an unbounded request would run to the context length. 64 tokens make
// the first turn's history long enough (over kv_recompute_threshold) for turn 2 to pull it.
const serveAnswerTokens = 64

// warmupConversation is the conversation id of Serve's own first turn, kept apart from the
// suggested requests' session-42.
const warmupConversation = "kvbridge-demo-warmup"

// firstQuestion is the seed guide's first turn.
const firstQuestion = "What is vLLM?"

// secondQuestion is the seed guide's second turn.
const secondQuestion = "How does disaggregated prefilling work?"

// Serve starts a bidirectional stack — P, D and the multi-turn proxy on loopback — prints curl
// commands to try, and keeps it running until ctx ends.
func Serve(ctx context.Context, opts ServeOptions) (err error) {
	if opts.Model == "" {
		opts.Model = model.Small
	}
	for _, p := range []*int{&opts.ProxyPort, &opts.PrefillPort, &opts.DecodePort} {
		if *p < 0 || *p > 65535 {
			return fmt.Errorf("demo: port %d is not a port number", *p)
		}
	}
	if opts.Out == nil {
		opts.Out = io.Discard
	}
	m, err := stack.OpenModel(ctx, opts.Model, nil)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer m.Close()
	cfg := conversation.Options{Model: m, Logger: opts.Logger}.StackConfig(stack.Bidirectional)
	cfg.Proxy.Port, cfg.P.Port, cfg.D.Port, cfg.FallbackToFreePorts = opts.ProxyPort, opts.PrefillPort, opts.DecodePort, true
	cfg.MaxModelLen, cfg.NumBlocks = 8192, 4096 // room for conversations of one's own
	s, err := stack.Start(ctx, cfg)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	defer func() {
		if cerr := s.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("demo: %w", cerr)
		}
	}()
	// The seed guide's second turn repeats the assistant's first answer; the proxy reuses D's KV
	// only for an exact continuation, so the suggested second request carries the answer this
	// model really gives (greedy, so the first curl gets the same text). It is asked under a
	// conversation id of its own.
	answer, err := firstAnswer(ctx, s.URL, m.Name())
	if err != nil {
		return err
	}
	if opts.ready != nil {
		opts.ready(s)
	}
	writeServeHelp(opts.Out, s, m.Name(), answer)
	<-ctx.Done()
	fmt.Fprintln(opts.Out, "\nstopping")
	return nil
}

// chatBody is a chat request as the guide writes it (fields in its order).
type chatBody struct {
	Model          string        `json:"model"`
	ConversationID string        `json:"conversation_id,omitempty"`
	Messages       []chatMessage `json:"messages"`
	MaxTokens      int           `json:"max_tokens"`
	Temperature    float64       `json:"temperature"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// firstTurn is the body of the guide's first turn.
func firstTurn(modelName string) chatBody {
	return chatBody{
		Model: modelName, ConversationID: "session-42", MaxTokens: serveAnswerTokens,
		Messages: []chatMessage{{Role: "user", Content: firstQuestion}},
	}
}

// secondTurn is the body of the guide's second turn, answer being the first turn's.
func secondTurn(modelName, answer string) chatBody {
	b := firstTurn(modelName)
	b.Messages = append(b.Messages, chatMessage{Role: "assistant", Content: answer}, chatMessage{Role: "user", Content: secondQuestion})
	return b
}

// firstAnswer asks the first turn through the proxy under warmupConversation and returns the
// answer.
func firstAnswer(ctx context.Context, proxyURL, modelName string) (string, error) {
	body := firstTurn(modelName)
	body.ConversationID = warmupConversation
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	url := proxyURL + "/v1/chat/completions"
	r, err := apiclient.Post(ctx, http.DefaultClient, url, body, nil)
	if err == nil {
		err = r.Check(url)
	}
	if err != nil {
		return "", fmt.Errorf("demo: asking the first turn: %w", err)
	}
	if r.Role != "assistant" {
		return "", fmt.Errorf("demo: the first turn's answer is not a chat completion: %.300s", r.Raw)
	}
	return r.Text, nil
}

// writeServeHelp prints the stack's addresses and the curl commands to try.
func writeServeHelp(w io.Writer, s *stack.Stack, modelName, answer string) {
	fmt.Fprintf(w, "kvbridge demo --serve: %s with bidirectional KV transfer (P's prefix caching off)\n", modelName)
	fmt.Fprintf(w, "  prefill (kv_producer)  %s\n  decode  (kv_consumer)  %s\n  multi-turn proxy       %s\n", s.P.URL(), s.D.URL(), s.URL)
	fmt.Fprintln(w, "\nTry the seed guide's two-turn chat through the proxy (-i shows the X-KVBridge-* headers:")
	fmt.Fprintln(w, "cache hit or miss, prompt tokens, tokens P pulled from D, tokens P computed). max_tokens keeps")
	fmt.Fprintln(w, "the built-in model's answers short; turn 2 repeats turn 1's real answer, as a chat client would.")
	fmt.Fprintln(w, "\n# Turn 1")
	fmt.Fprintln(w, curlCommand(s.URL, firstTurn(modelName)))
	fmt.Fprintln(w, "\n# Turn 2 — same conversation_id: P pulls the conversation's KV from D")
	fmt.Fprintln(w, curlCommand(s.URL, secondTurn(modelName, answer)))
	fmt.Fprintln(w, "\nTurn 2 answers with X-KVBridge-Cache: hit and X-KVBridge-Prefill-Pulled-Tokens > 0: P read turn 1's")
	fmt.Fprintln(w, "verified KV blocks from D and computed only the rest. (Fewer than kv_recompute_threshold = 64")
	fmt.Fprintln(w, "pullable tokens are recomputed instead; an edited history is a miss.) Proxy health:")
	fmt.Fprintf(w, "curl %s/health\n\nPress Ctrl-C to stop.\n", s.URL)
}

// curlCommand returns a shell command posting body to the proxy's chat route.
func curlCommand(base string, body chatBody) string {
	data, _ := json.MarshalIndent(body, "  ", "  ")
	return fmt.Sprintf("curl -i %s/v1/chat/completions \\\n  -H \"Content-Type: application/json\" \\\n  -d %s", base, shellQuote(string(data)))
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
