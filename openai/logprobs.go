package openai

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
	"unicode/utf8"

	"github.com/kvbridge/kvbridge/model"
	"github.com/kvbridge/kvbridge/model/tokenizer"
)

// The logprobs shapes of vLLM's OpenAI server. vLLM keeps, per position, a dict of the token
// that stands there followed by the most likely tokens in rank order (a token already present
// keeps its first place): chat's top_logprobs are the first top_logprobs entries of that dict,
// completions' the first logprobs+1, keyed by their text. Logprobs below −9999 (−Inf) are
// reported as −9999.

// minLogprob is the value vLLM reports for −Inf logprobs.
const minLogprob = -9999.0

// clampLogprob returns lp, at least minLogprob.
func clampLogprob(lp float64) float64 { return math.Max(lp, minLogprob) }

// entries returns a position's dict in vLLM's order: the token, then the top tokens not yet in.
func entries(p model.PositionLogprobs) []model.TokenLogprob {
	out := make([]model.TokenLogprob, 0, len(p.Top)+1)
	out = append(out, p.Token)
	for _, t := range p.Top {
		if t.ID == p.Token.ID {
			out[0] = t // the dict entry is overwritten in place
			continue
		}
		out = append(out, t)
	}
	return out
}

// tokenText is vLLM's decoded token: the token decoded alone, special tokens included, invalid
// UTF-8 as U+FFFD.
func tokenText(tok *tokenizer.Tokenizer, id int32) string { return tok.Decode([]int32{id}) }

// byteList is a token's UTF-8 bytes as a JSON array of integers.
type byteList []byte

// MarshalJSON writes the bytes as numbers, not base64.
func (b byteList) MarshalJSON() ([]byte, error) {
	out := make([]byte, 0, 4*len(b)+2)
	out = append(out, '[')
	for i, c := range b {
		if i > 0 {
			out = append(out, ',')
		}
		out = strconv.AppendInt(out, int64(c), 10)
	}
	return append(out, ']'), nil
}

// chatLogprob is one entry of a chat top_logprobs list.
type chatLogprob struct {
	Token   string   `json:"token"`
	Logprob float64  `json:"logprob"`
	Bytes   byteList `json:"bytes"`
}

// chatLogprobContent is one position of chat logprobs.content.
type chatLogprobContent struct {
	Token       string        `json:"token"`
	Logprob     float64       `json:"logprob"`
	Bytes       byteList      `json:"bytes"`
	TopLogprobs []chatLogprob `json:"top_logprobs"`
}

// chatLogprobs is a chat choice's logprobs object.
type chatLogprobs struct {
	Content []chatLogprobContent `json:"content"`
}

// newChatLogprobs builds the chat logprobs of positions with top entries each (−1: all).
func newChatLogprobs(tok *tokenizer.Tokenizer, positions []model.PositionLogprobs, top int) *chatLogprobs {
	out := &chatLogprobs{Content: make([]chatLogprobContent, 0, len(positions))}
	for _, p := range positions {
		text := tokenText(tok, p.Token.ID)
		c := chatLogprobContent{Token: text, Logprob: clampLogprob(p.Token.Logprob), Bytes: byteList(text), TopLogprobs: []chatLogprob{}}
		for i, e := range entries(p) {
			if top >= 0 && i >= top {
				break
			}
			t := tokenText(tok, e.ID)
			c.TopLogprobs = append(c.TopLogprobs, chatLogprob{Token: t, Logprob: clampLogprob(e.Logprob), Bytes: byteList(t)})
		}
		out.Content = append(out.Content, c)
	}
	return out
}

// orderedFloats is a JSON object of token texts to logprobs, in insertion order; a repeated
// key keeps its place and takes the later value, as a Python dict does.
type orderedFloats struct {
	keys []string
	vals []float64
}

func (o *orderedFloats) set(k string, v float64) {
	for i, have := range o.keys {
		if have == k {
			o.vals[i] = v
			return
		}
	}
	o.keys, o.vals = append(o.keys, k), append(o.vals, v)
}

// MarshalJSON writes the object in insertion order.
func (o *orderedFloats) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, k := range o.keys {
		if i > 0 {
			b.WriteByte(',')
		}
		kb, _ := json.Marshal(k)
		b.Write(kb)
		b.WriteByte(':')
		vb, err := json.Marshal(o.vals[i])
		if err != nil {
			return nil, err
		}
		b.Write(vb)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// completionLogprobs is a completion choice's logprobs object.
type completionLogprobs struct {
	TextOffset    []int            `json:"text_offset"`
	TokenLogprobs []*float64       `json:"token_logprobs"`
	Tokens        []string         `json:"tokens"`
	TopLogprobs   []*orderedFloats `json:"top_logprobs"`
}

// newCompletionLogprobs builds the logprobs of tokens; positions[i] belongs to tokens[i] and is
// nil where there is none (the first prompt token). top is the request's logprobs value; the
// first text offset is offset, the next ones add each token's length in characters.
func newCompletionLogprobs(tok *tokenizer.Tokenizer, tokens []int32, positions []*model.PositionLogprobs, top, offset int) *completionLogprobs {
	out := &completionLogprobs{TextOffset: []int{}, TokenLogprobs: []*float64{}, Tokens: []string{}, TopLogprobs: []*orderedFloats{}}
	last := 0
	for i, id := range tokens {
		text := tokenText(tok, id)
		out.Tokens = append(out.Tokens, text)
		if p := positions[i]; p == nil {
			out.TokenLogprobs = append(out.TokenLogprobs, nil)
			out.TopLogprobs = append(out.TopLogprobs, nil)
		} else {
			lp := clampLogprob(p.Token.Logprob)
			out.TokenLogprobs = append(out.TokenLogprobs, &lp)
			top1 := &orderedFloats{}
			for k, e := range entries(*p) {
				if top >= 0 && k > top {
					break
				}
				top1.set(tokenText(tok, e.ID), clampLogprob(e.Logprob))
			}
			out.TopLogprobs = append(out.TopLogprobs, top1)
		}
		if i == 0 {
			out.TextOffset = append(out.TextOffset, offset)
		} else {
			out.TextOffset = append(out.TextOffset, out.TextOffset[i-1]+last)
		}
		last = utf8.RuneCountInString(text)
	}
	return out
}

// promptLogprobs is vLLM's prompt_logprobs: null for the first prompt token, then per token an
// object of token id → {logprob, rank, decoded_token}.
type promptLogprobs struct {
	tok       *tokenizer.Tokenizer
	positions []model.PositionLogprobs
}

// MarshalJSON writes the list.
func (p promptLogprobs) MarshalJSON() ([]byte, error) {
	type entry struct {
		Logprob      float64 `json:"logprob"`
		Rank         int     `json:"rank"`
		DecodedToken string  `json:"decoded_token"`
	}
	var b bytes.Buffer
	b.WriteString("[null")
	for _, pos := range p.positions {
		b.WriteString(",{")
		for i, e := range entries(pos) {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteByte('"')
			b.WriteString(strconv.Itoa(int(e.ID)))
			b.WriteString(`":`)
			v, err := json.Marshal(entry{Logprob: clampLogprob(e.Logprob), Rank: e.Rank, DecodedToken: tokenText(p.tok, e.ID)})
			if err != nil {
				return nil, err
			}
			b.Write(v)
		}
		b.WriteByte('}')
	}
	b.WriteByte(']')
	return b.Bytes(), nil
}
