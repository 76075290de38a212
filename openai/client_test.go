package openai

import (
	"context"
	"errors"
	"testing"

	oai "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

// TestOfficialClient drives the server with github.com/openai/openai-go: a chat completion and
// the same request streamed must agree (greedy), with usage on both.
func TestOfficialClient(t *testing.T) {
	e := newEnv(t, func(c *Config) { c.APIKey = "test-key" })
	client := oai.NewClient(
		option.WithBaseURL(e.http.URL+"/v1/"),
		option.WithAPIKey("test-key"),
		option.WithHTTPClient(e.http.Client()),
		option.WithMaxRetries(0),
	)
	ctx, cancel := context.WithTimeout(t.Context(), testWait)
	defer cancel()
	params := oai.ChatCompletionNewParams{
		Model:               testModelName,
		Messages:            []oai.ChatCompletionMessageParamUnion{oai.SystemMessage("Be brief."), oai.UserMessage("Say something.")},
		MaxCompletionTokens: oai.Int(8),
		Temperature:         oai.Float(0),
		Seed:                oai.Int(0),
	}
	res, err := client.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatalf("chat completion: %v", err)
	}
	if len(res.Choices) != 1 || res.Choices[0].Message.Role != "assistant" || res.Object != "chat.completion" {
		t.Fatalf("response = %+v", res)
	}
	if res.Usage.PromptTokens <= 0 || res.Usage.CompletionTokens <= 0 || res.Usage.CompletionTokens > 8 {
		t.Errorf("usage = %+v", res.Usage)
	}

	params.StreamOptions = oai.ChatCompletionStreamOptionsParam{IncludeUsage: oai.Bool(true)}
	stream := client.Chat.Completions.NewStreaming(ctx, params)
	var acc oai.ChatCompletionAccumulator
	chunks := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		chunks++
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	if err := stream.Close(); err != nil {
		t.Errorf("close stream: %v", err)
	}
	if chunks < 2 || len(acc.Choices) != 1 {
		t.Fatalf("%d chunks, accumulated %+v", chunks, acc.ChatCompletion)
	}
	if got, want := acc.Choices[0].Message.Content, res.Choices[0].Message.Content; got != want {
		t.Errorf("streamed content %q, non-streamed %q", got, want)
	}
	if acc.Choices[0].FinishReason != res.Choices[0].FinishReason {
		t.Errorf("finish reason %q vs %q", acc.Choices[0].FinishReason, res.Choices[0].FinishReason)
	}
	if acc.Usage.CompletionTokens != res.Usage.CompletionTokens || acc.Usage.PromptTokens != res.Usage.PromptTokens {
		t.Errorf("stream usage %+v, non-stream usage %+v", acc.Usage, res.Usage)
	}

	// An error status surfaces as *openai.Error with the server's message.
	params.Model = "nope"
	_, err = client.Chat.Completions.New(ctx, params)
	var apiErr *oai.Error
	if !asError(err, &apiErr) || apiErr.StatusCode != 404 {
		t.Errorf("unknown model: err = %v", err)
	}
}

func asError(err error, target **oai.Error) bool { return errors.As(err, target) }
