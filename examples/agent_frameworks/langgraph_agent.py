"""A LangGraph agent over LangChain's `ChatOpenAI`, trained as it is written: `rollout.agent.entrypoint=
examples/agent_frameworks/langgraph_agent.py:run`. The framework builds its own OpenAI client from the episode's
`client.base_url` and `client.api_key` (the key names the episode: what it samples is recorded under it)."""

from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph


def build_graph(llm):
    async def answer(state: MessagesState):
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    graph.add_edge("answer", END)
    return graph.compile()


async def run(sample, client):
    llm = ChatOpenAI(model="policy", base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    state = await build_graph(llm).ainvoke({"messages": [HumanMessage(sample["prompt"])]})
    return float(state["messages"][-1].content.strip() == str(sample["extra"]["ground_truth"]))
